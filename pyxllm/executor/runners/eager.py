"""The eager runner: plain PyTorch, the reference every other runner must match."""
from __future__ import annotations

import torch
from torch import nn


class EagerRunner:
    """Calls ``model(input_ids [T], positions [T]) -> hidden [T, hidden]`` directly."""

    name = "eager"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)
