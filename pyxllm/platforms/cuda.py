"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch.

Attention uses flash-attn when it is installed (and ``--block-size`` is a multiple of 256, what
its paged KV cache takes), else the pure-PyTorch backend; kernels are ``pyxllm.kernels.cuda``.
Graphs are CUDA graphs; collectives use NCCL.
"""

import torch

from pyxllm.platforms import interface
from pyxllm.platforms.interface import (
    DeviceGraphs,
    FusedAttention,
    Platform,
    PlatformUnavailableError,
)

# What ``pyxllm env`` reports for this platform (``pyxllm.platforms.environment``): the package
# that provides it (a CUDA or ROCm build of torch) and the name prefixes of its shared libraries
# (the driver, the CUDA runtime and libraries, NCCL, torch's CUDA parts; ROCm's for a ROCm build;
# flash-attn), and the environment variables that steer it.
PACKAGE = "torch"
SHARED_LIBRARIES = (
    "libtorch_cuda",
    "libc10_cuda",
    "libcuda.",
    "libcudart",
    "libcublas",
    "libcudnn",
    "libcufft",
    "libcurand",
    "libcusolver",
    "libcusparse",
    "libcupti",
    "libnccl",
    "libnvrtc",
    "libnvJitLink",
    "libnvToolsExt",
    "libtorch_hip",
    "libc10_hip",
    "libamdhip64",
    "librccl",
    "libMIOpen",
    "librocblas",
    "libhipblas",
    "flash_attn",
)
ENV_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_", "HIP_", "ROCR_")

CUDA_PLATFORM = Platform(
    name="cuda",
    torch_device="cuda",
    kernels_module="pyxllm.kernels.cuda",
    runners=("eager", "compile", "graph"),
    dist_backend="nccl",
    default_dtype=torch.bfloat16,
    fused_attention=(
        FusedAttention("flash_attn", "pyxllm.attention.flash_attn:FlashAttnBackend", 256),
    ),
    graph_capture=DeviceGraphs("CUDAGraph"),
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    ray_resource="GPU",
)


def is_available() -> bool:
    """Whether torch was built with CUDA and sees at least one GPU."""
    return torch.cuda.is_available()


def load() -> Platform:
    """The CUDA platform.

    Raises:
        PlatformUnavailableError: torch lacks CUDA (naming the reinstall command) or sees no GPU.
    """
    if torch.version.cuda is None:
        release = interface.torch_release()
        raise PlatformUnavailableError(
            f"device cuda needs a CUDA build of torch, but torch {torch.__version__} was built "
            f"without CUDA; pip install --force-reinstall torch=={release} (PyPI's Linux wheels "
            "are built with CUDA)"
        )
    if not is_available():
        raise PlatformUnavailableError(
            f"device cuda: torch (CUDA {torch.version.cuda}) sees no GPU; check "
            "CUDA_VISIBLE_DEVICES and the NVIDIA driver (nvidia-smi)"
        )
    return CUDA_PLATFORM
