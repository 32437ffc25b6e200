"""The eager runner: plain PyTorch, the reference every other runner must match."""

from __future__ import annotations

import torch

from pyxllm.executor.runners.base import Runner


class EagerRunner(Runner):
    """Calls ``model(input_ids [T], positions [T]) -> hidden [T, hidden]`` directly."""

    name = "eager"

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)
