"""The MLU platform: Cambricon cards through ``torch_mlu``.

Kernels are ``pyxllm.kernels.mlu`` (the pure-PyTorch ones, which torch_mlu runs on the card);
attention is the pure-PyTorch paged backend; collectives use CNCL. Only the eager runner is
offered until MLU graphs are checked on a card.
"""

import importlib

import torch

from pyxllm.platforms import interface
from pyxllm.platforms.interface import Platform, PlatformUnavailableError

MLU_PLATFORM = Platform(
    name="mlu",
    torch_device="mlu",
    kernels_module="pyxllm.kernels.mlu",
    attention_backend="pyxllm.attention.torch_paged:TorchPagedAttentionBackend",
    runners=("eager",),
    dist_backend="cncl",
    default_dtype=torch.float16,
    visible_devices_env="MLU_VISIBLE_DEVICES",
)

PACKAGE = "torch_mlu"


def install_hint() -> str:
    """The install command for the torch_mlu matching the installed torch (not on PyPI)."""
    release = interface.torch_release()
    return (
        f"pip install the torch_mlu wheel built for torch {release} from Cambricon's "
        "Cambricon PyTorch release (pip install torch_mlu-<version>-<python>-linux_x86_64.whl)"
    )


def is_available() -> bool:
    """Whether torch_mlu is installed and sees at least one MLU (imports torch_mlu if installed)."""
    if not interface.package_installed(PACKAGE):
        return False
    importlib.import_module(PACKAGE)
    return torch.mlu.is_available()


def load() -> Platform:
    """The MLU platform.

    Raises:
        PlatformUnavailableError: torch_mlu is not installed (naming the install command) or sees no
            MLU.
    """
    if not interface.package_installed(PACKAGE):
        raise PlatformUnavailableError(
            "device mlu needs torch_mlu (Cambricon's PyTorch adapter), which is not installed; "
            f"{install_hint()}"
        )
    if not is_available():
        raise PlatformUnavailableError(
            "device mlu: torch_mlu sees no MLU; check MLU_VISIBLE_DEVICES and the driver (cnmon)"
        )
    return MLU_PLATFORM
