"""The host CPU's feature flags and model name, read from ``/proc/cpuinfo`` once per process.

Three readers need them: the CPU platform's default dtype (bfloat16 where the CPU computes it
natively, ``pyxllm.platforms.cpu``), the fused kernels' build, whose cache key includes them
(``pyxllm.kernels.cpu.fused``), and ``pyxllm env``, which shows :data:`KEY_FEATURES`.
"""

from __future__ import annotations

import functools
import platform

CPUINFO = "/proc/cpuinfo"

# The flags pyxllm's choices depend on, and what each gives (``pyxllm env`` shows them).
KEY_FEATURES = {
    "avx2": "8-lane float32 vectors, the unit of the fused kernels",
    "avx512f": "16-lane float32 vectors (torch's AVX512 kernels)",
    "avx512_bf16": "bfloat16 by default (--dtype auto) and bf16 dot products in the fused decode "
    "attention",
    "amx_bf16": "bfloat16 by default (--dtype auto); oneDNN's AMX bf16 matmuls",
    "avx512_vnni": "int8 dot products: fast --quantization w8a8 matmuls (oneDNN)",
    "avx_vnni": "int8 dot products: fast --quantization w8a8 matmuls (oneDNN)",
    "amx_int8": "AMX int8 tiles: fast --quantization w8a8 matmuls (oneDNN)",
}


def cpu_feature_line(cpuinfo_path: str = CPUINFO) -> str:
    """The first CPU's feature line of ``cpuinfo_path`` as written there (``flags : ...`` on x86,
    ``Features : ...`` on Arm, newline included); ``""`` where it cannot be read. Read once per
    path and process."""
    return _first_line(cpuinfo_path, ("flags", "Features"))


@functools.cache
def _first_line(cpuinfo_path: str, prefixes: tuple[str, ...]) -> str:
    try:
        with open(cpuinfo_path) as f:
            return next((line for line in f if line.startswith(prefixes)), "")
    except OSError:
        return ""


def cpu_flags(cpuinfo_path: str = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags (``avx512_bf16``, ...); empty where they cannot be read."""
    return frozenset(cpu_feature_line(cpuinfo_path).partition(":")[2].split())


def cpu_model_name(cpuinfo_path: str = CPUINFO) -> str:
    """The first CPU's ``model name`` (``AMD EPYC 9654 96-Core Processor``); where
    ``cpuinfo_path`` has none (Arm, other systems), ``platform.processor()`` or the machine type
    (``aarch64``)."""
    name = _first_line(cpuinfo_path, ("model name",)).partition(":")[2].strip()
    return name or platform.processor() or platform.machine()
