"""The host CPU's feature flags, read from ``/proc/cpuinfo`` once per process.

Two readers need them: the CPU platform's default dtype (bfloat16 where the CPU computes it
natively, ``pyxllm.platforms.cpu``) and the fused kernels' build, whose cache key includes them
(``pyxllm.kernels.cpu.fused``).
"""

from __future__ import annotations

import functools

CPUINFO = "/proc/cpuinfo"


def cpu_feature_line(cpuinfo_path: str = CPUINFO) -> str:
    """The first CPU's feature line of ``cpuinfo_path`` as written there (``flags : ...`` on x86,
    ``Features : ...`` on Arm, newline included); ``""`` where it cannot be read. Read once per
    path and process."""
    return _read_feature_line(cpuinfo_path)


@functools.cache
def _read_feature_line(cpuinfo_path: str) -> str:
    try:
        with open(cpuinfo_path) as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags(cpuinfo_path: str = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags (``avx512_bf16``, ...); empty where they cannot be read."""
    return frozenset(cpu_feature_line(cpuinfo_path).partition(":")[2].split())
