"""The MLU platform: Cambricon cards through ``torch_mlu``.

Kernels are ``pyxllm.kernels.mlu`` (the pure-PyTorch ones, which torch_mlu runs on the card);
attention is the pure-PyTorch paged backend; collectives use CNCL. Only the eager runner is
offered until MLU graphs are checked on a card.
"""

import torch

from pyxllm.platforms.adapter import AdapterPackage
from pyxllm.platforms.interface import Platform

MLU_PLATFORM = Platform(
    name="mlu",
    torch_device="mlu",
    kernels_module="pyxllm.kernels.mlu",
    runners=("eager",),
    dist_backend="cncl",
    default_dtype=torch.float16,
    visible_devices_env="MLU_VISIBLE_DEVICES",
    ray_resource="MLU",
)

# torch_mlu is not on PyPI: Cambricon publishes wheels per torch release
ADAPTER = AdapterPackage(
    MLU_PLATFORM,
    package="torch_mlu",
    description="Cambricon's PyTorch adapter",
    install="pip install the torch_mlu wheel built for torch {release} from Cambricon's "
    "Cambricon PyTorch release (pip install torch_mlu-<version>-<python>-linux_x86_64.whl)",
    no_card_checks="MLU_VISIBLE_DEVICES and the driver (cnmon)",
)
is_available, load = ADAPTER.is_available, ADAPTER.load
# What ``pyxllm env`` reports (``pyxllm.platforms.environment``): the package, and the name
# prefixes of its shared libraries besides those in the package's directory (Cambricon's
# runtime, driver, operator and collective libraries), and the environment variables that
# steer it.
PACKAGE = ADAPTER.package
SHARED_LIBRARIES = (
    "libtorch_mlu",
    "libcnrt",
    "libcndrv",
    "libcnnl",
    "libcncl",
    "libcnpapi",
    "libcndev",
    "libcnbin",
    "libmagicmind",
)
ENV_PREFIXES = ("MLU_", "CNCL_", "NEUWARE_")
