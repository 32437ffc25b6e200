"""What the layers' weight loaders share."""

from __future__ import annotations

import torch


def materialize(weight) -> torch.Tensor:
    """``weight`` itself when it is a tensor; else an unread checkpoint slice (a narrowed
    ``pyxllm.weights.lazy.LazyWeight``: anything with ``load()``), read now.

    Loaders narrow what they receive to this rank's rows or columns first and call this last,
    so a tensor-parallel rank reads only its own slice of the checkpoint.
    """
    return weight if isinstance(weight, torch.Tensor) else weight.load()
