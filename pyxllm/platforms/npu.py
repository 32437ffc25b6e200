"""The NPU platform: Huawei Ascend cards through ``torch_npu``.

Kernels (``pyxllm.kernels.npu``) and attention (``pyxllm.attention.npu``) use torch_npu's fused
ops; graphs are ACL graphs (``torch.npu.NPUGraph``); collectives use HCCL. Every rank sees all
cards through ``ASCEND_RT_VISIBLE_DEVICES`` and takes the one at its local rank.
"""

import importlib

import torch

from pyxllm.platforms import interface
from pyxllm.platforms.interface import (
    DeviceGraphs,
    FusedAttention,
    Platform,
    PlatformUnavailableError,
)

NPU_PLATFORM = Platform(
    name="npu",
    torch_device="npu",
    kernels_module="pyxllm.kernels.npu",
    attention_backend="pyxllm.attention.torch_paged:TorchPagedAttentionBackend",
    runners=("eager", "graph"),
    dist_backend="hccl",
    default_dtype=torch.bfloat16,
    fused_attention=(FusedAttention("torch_npu", "pyxllm.attention.npu:NPUAttentionBackend"),),
    graph_capture=DeviceGraphs("NPUGraph"),
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
)

PACKAGE = "torch_npu"


def install_hint() -> str:
    """The install command for the torch_npu matching the installed torch."""
    release = interface.torch_release()
    return (
        f"pip install torch-npu=={release} (its version must match torch {release}), then "
        "source the CANN toolkit's set_env.sh"
    )


def is_available() -> bool:
    """Whether torch_npu is installed and sees at least one NPU (imports torch_npu if installed)."""
    if not interface.package_installed(PACKAGE):
        return False
    importlib.import_module(PACKAGE)
    return torch.npu.is_available()


def load() -> Platform:
    """The NPU platform.

    Raises:
        PlatformUnavailableError: torch_npu is not installed (naming the pip command) or sees no
            NPU.
    """
    if not interface.package_installed(PACKAGE):
        raise PlatformUnavailableError(
            "device npu needs torch_npu (Ascend's PyTorch adapter), which is not installed; "
            f"{install_hint()}"
        )
    if not is_available():
        raise PlatformUnavailableError(
            "device npu: torch_npu sees no NPU; check ASCEND_RT_VISIBLE_DEVICES, the driver "
            "(npu-smi info) "
            "and that the CANN toolkit's set_env.sh was sourced"
        )
    return NPU_PLATFORM
