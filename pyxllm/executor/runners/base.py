"""What every runner offers the executor."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pyxllm.layers.forward_context import ForwardContext, set_forward_context


class Runner:
    """Runs the model forward for one step.

    ``runner(input_ids [T], positions [T]) -> hidden [T, hidden]`` runs inside a forward context
    the caller has set (``positions [3, T]``: an mRoPE model's step with image tokens);
    ``runner.execute(batch, make_context)`` is what the executor calls, and lets a runner skip
    building the context (a graph replay needs none).
    """

    name = "base"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def execute(self, batch, make_context: Callable[[object], ForwardContext]) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of an ``InputBatch``; ``make_context(batch)`` builds its
        forward context."""
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        with set_forward_context(make_context(batch)):
            return self(batch.input_ids, positions)
