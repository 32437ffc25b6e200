"""``--dtype auto`` on the CPU: bfloat16 where the CPU has native bf16 (avx512_bf16/amx_bf16),
float32 elsewhere, and ``PYXLLM_CPU_DEFAULT_DTYPE`` overrides (the suite pins float32)."""
from __future__ import annotations

import pytest
import torch

from pyxllm.platforms.cpu import CPU_PLATFORM, cpu_default_dtype, cpu_flags


def test_bfloat16_only_with_native_bf16_flags():
    assert cpu_default_dtype({"avx2", "avx512f", "avx512_bf16"}, override="") == torch.bfloat16
    assert cpu_default_dtype({"amx_bf16", "amx_tile"}, override="") == torch.bfloat16
    assert cpu_default_dtype({"avx2", "avx512f"}, override="") == torch.float32
    assert cpu_default_dtype(set(), override="") == torch.float32


def test_override_wins_and_is_checked():
    assert cpu_default_dtype({"avx512_bf16"}, override="float32") == torch.float32
    assert cpu_default_dtype(set(), override="bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="PYXLLM_CPU_DEFAULT_DTYPE"):
        cpu_default_dtype(set(), override="float16")


def test_the_suite_runs_in_float32_and_flags_are_read(tmp_path):
    assert CPU_PLATFORM.default_dtype == torch.float32  # pinned by tests/conftest.py
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
