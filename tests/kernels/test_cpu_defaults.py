"""``--dtype auto`` on the CPU: bfloat16 where the CPU has native bf16 (avx512_bf16/amx_bf16),
float32 elsewhere, and ``PYXLLM_CPU_DEFAULT_DTYPE`` overrides (the suite pins float32)."""

from __future__ import annotations

import pytest
import torch

from pyxllm.kernels.cpu.features import cpu_flags
from pyxllm.platforms import cpu
from pyxllm.platforms.cpu import cpu_default_dtype


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
    assert cpu.load().default_dtype == torch.float32  # pinned by tests/conftest.py
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_bfloat16_decode_agrees_with_bfloat16_prefill():
    """End to end in bfloat16 (the CPU default the rest of the suite does not run): the logprob
    of each greedily decoded token, computed by the decode path (one token a step, the fused
    paged decode attention), matches the same position recomputed by one prefill of the whole
    text (SDPA), within bf16 rounding, and is the top token there too."""
    from pyxllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=256, kv_cache_memory=0.05)
    out = llm.generate(
        ["The three primary colors are"], SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    )[0]
    tokens = out.outputs[0].token_ids
    decoded = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    full = out.prompt_token_ids + tokens
    again = llm.generate(
        [{"prompt_token_ids": full}], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )[0]
    start = len(out.prompt_token_ids)
    prefilled = [again.prompt_logprobs[start + i][t] for i, t in enumerate(tokens)]
    assert len(tokens) == 24
    for i, (d, p) in enumerate(zip(decoded, prefilled)):
        assert abs(d - p.logprob) < 0.15 + 0.05 * abs(p.logprob), (i, d, p.logprob)
    assert sum(p.rank == 1 for p in prefilled) >= 22  # a near-tie may flip under bf16 rounding
