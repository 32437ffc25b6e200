"""The NPU platform: Huawei Ascend cards through ``torch_npu``.

Kernels (``pyxllm.kernels.npu``) and attention (``pyxllm.attention.npu``) use torch_npu's fused
ops; graphs are ACL graphs (``torch.npu.NPUGraph``); collectives use HCCL. Every rank sees all
cards through ``ASCEND_RT_VISIBLE_DEVICES`` and takes the one at its local rank.
"""

import torch

from pyxllm.platforms.adapter import AdapterPackage
from pyxllm.platforms.interface import DeviceGraphs, FusedAttention, Platform

NPU_PLATFORM = Platform(
    name="npu",
    torch_device="npu",
    kernels_module="pyxllm.kernels.npu",
    runners=("eager", "graph"),
    dist_backend="hccl",
    default_dtype=torch.bfloat16,
    fused_attention=(FusedAttention("torch_npu", "pyxllm.attention.npu:NPUAttentionBackend"),),
    graph_capture=DeviceGraphs("NPUGraph"),
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
    ray_resource="NPU",
)

ADAPTER = AdapterPackage(
    NPU_PLATFORM,
    package="torch_npu",
    description="Ascend's PyTorch adapter",
    install="pip install torch-npu=={release} (its version must match torch {release}), then "
    "source the CANN toolkit's set_env.sh",
    no_card_checks="ASCEND_RT_VISIBLE_DEVICES, the driver (npu-smi info) and that the CANN "
    "toolkit's set_env.sh was sourced",
)
is_available, load = ADAPTER.is_available, ADAPTER.load
# What ``pyxllm env`` reports (``pyxllm.platforms.environment``): the package, and the name
# prefixes of its shared libraries besides those in the package's directory (the CANN toolkit's
# runtime, graph engine, operator and collective libraries), and the environment variables that
# steer it.
PACKAGE = ADAPTER.package
SHARED_LIBRARIES = (
    "libtorch_npu",
    "libascend",
    "libacl",
    "libhccl",
    "libge_",
    "libgraph.",
    "libruntime.",
    "libopapi",
    "libnnopbase",
)
ENV_PREFIXES = ("ASCEND_", "HCCL_", "ACL_")
