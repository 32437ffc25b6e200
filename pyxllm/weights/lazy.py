"""Checkpoint tensors that are read only when, and only as much as, a weight loader asks.

Under tensor parallelism a rank needs a slice of most tensors (a block of rows of a
column-parallel weight, a block of columns of a row-parallel one, a range of vocabulary rows).
:class:`LazyWeight` stands for a whole checkpoint tensor; ``narrow`` costs nothing and ``load()``
reads just the narrowed region from the file:

- safetensors: ``safe_open(...).get_slice(name)[rows, cols]`` reads only those bytes of the
  memory-mapped file, for row (column-parallel, vocabulary) and column (row-parallel) splits.
- GGUF: quantization blocks run along the last (input) dimension and rows are independent, so a
  row range is dequantized alone; a column range aligned to the block size (32 values for Q4/Q8;
  SmolLM2's splits at tp 3 are) reads only those blocks of each row, an unaligned one dequantizes
  its rows whole and cuts them. llama's permuted ``attn_q``/``attn_k`` are read in whole heads
  (a rank's shard always is), then un-permuted.
- Not split: vectors (norms, biases: small, read whole, then cut) and replicated tensors (the
  MoE router, per-head q/k norms), which every rank reads in full.

Weight loaders (``pyxllm.layers``) narrow what they receive, then call
``layers.weight_utils.materialize``, so they accept a plain tensor too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class StoredGroups:
    """A region of a checkpoint tensor as its file stores it, in a grouped format a kernel takes
    (GGUF's quantization blocks, ``pyxllm.weights.gguf_blocks``): groups of ``group_size`` input
    features, each with a scale and a zero per row.

    Attributes:
        format: ``"int4"``: ``W = (q - 8) * scale + zero``, ``q`` uint8 in 0..15; ``"int8"``:
            ``W = q * scale + zero``, ``q`` int8.
        q: ``[rows, cols]``; scale, zero: float32 ``[rows, cols / group_size]``.
        group_size: 32, or 16 (GGUF's Q6_K).
        super_d, super_sub, super_shift: the same scales as the file factors them, or
            ``None``: float32 ``[rows, cols / 256, P]`` and int8 ``[rows, cols / group_size,
            P]``, ``W = (q + super_shift) d sc + dlow m``
            (``pyxllm.kernels.native.quantized.SuperBlockScales``; GGUF's K-quants and IQ4_XS).
    """

    format: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int = 32
    super_d: torch.Tensor | None = None
    super_sub: torch.Tensor | None = None
    super_shift: int = 0


class LazyWeight:
    """A checkpoint tensor of ``full_shape`` narrowed to ``ranges`` (one ``(start, stop)`` per dim).

    Subclasses implement ``_read(ranges) -> Tensor`` (a new tensor of exactly that region, in the
    checkpoint's dtype, or float32 for GGUF). Stays valid only while the iterator that yielded it
    has not moved on (the file may be closed afterwards).

    Attributes:
        name: the checkpoint name, for messages.
    """

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name = name
        self.full_shape = tuple(int(n) for n in shape)
        self.ranges = tuple((0, n) for n in self.full_shape)

    @property
    def shape(self) -> torch.Size:
        """The shape ``load()`` will return."""
        return torch.Size(stop - start for start, stop in self.ranges)

    def dim(self) -> int:
        return len(self.ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        """The same region as ``tensor.narrow(dim, start, length)``, still unread.

        Raises:
            ValueError: the range falls outside the tensor (naming it and its shape).
        """
        dim = dim % self.dim()
        begin, stop = self.ranges[dim]
        if start < 0 or length < 0 or start + length > stop - begin:
            raise ValueError(
                f"rows/columns {start}..{start + length} of dim {dim} are outside "
                f"{self.name} {tuple(self.shape)}"
            )
        view = copy.copy(self)
        view.ranges = (
            *self.ranges[:dim],
            (begin + start, begin + start + length),
            *self.ranges[dim + 1 :],
        )
        return view

    def load(self) -> torch.Tensor:
        """Read the narrowed region from the file."""
        return self._read(self.ranges)

    def load_stored(self) -> StoredGroups | None:
        """The narrowed region in the file's own grouped format, or ``None`` where the file does
        not store it in one a kernel takes (then ``load()`` gives its values)."""
        return None

    def _read(self, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {tuple(self.shape)} of {self.full_shape})"
