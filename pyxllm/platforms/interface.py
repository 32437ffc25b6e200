"""What every device platform tells the rest of pyxllm."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Platform:
    """A device platform: the one place that knows device-specific choices.

    Attributes:
        name: the ``--device`` spelling (``cpu``, ``cuda``, ``npu``, ``mlu``).
        torch_device: the ``torch.device`` type string.
        kernels_module: the kernel package bound to ``pyxllm.kernels.ops``.
        attention_backend: ``"module:Class"`` of the attention backend the executor builds.
        runners: the ``--graph-backend`` kinds this platform supports.
        dist_backend: the ``torch.distributed`` backend for tensor parallelism.
        default_dtype: what ``--dtype auto`` means here, unless the checkpoint says otherwise.
    """

    name: str
    torch_device: str
    kernels_module: str
    attention_backend: str
    runners: tuple[str, ...]
    dist_backend: str
    default_dtype: torch.dtype

    def device(self, index: int = 0) -> torch.device:
        """The ``torch.device`` this process computes on."""
        return torch.device(self.torch_device) if self.torch_device == "cpu" else torch.device(self.torch_device, index)
