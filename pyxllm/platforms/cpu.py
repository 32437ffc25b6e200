"""The CPU platform: pure-PyTorch kernels, float32 by default, gloo for collectives."""
import torch

from pyxllm.platforms.interface import Platform

CPU_PLATFORM = Platform(
    name="cpu",
    torch_device="cpu",
    kernels_module="pyxllm.kernels.cpu",
    attention_backend="pyxllm.attention.torch_paged:TorchPagedAttentionBackend",
    runners=("eager", "compile"),
    dist_backend="gloo",
    default_dtype=torch.float32,
    float16_dtype=torch.bfloat16,
)


def is_available() -> bool:
    """The CPU is always there."""
    return True


def load() -> Platform:
    """The CPU platform (never fails)."""
    return CPU_PLATFORM
