"""``--kv-cache-dtype int8``: the quantized row format and its error bound, the fused kernels
against the reference, the blocks that fit, outputs that do not depend on the prefix cache,
chunked prefill or the graph runner, and the distributions against a bfloat16 cache.

Accuracy measured here (default model, 4 prompts, 53 positions, full-vocabulary
log-probabilities): an int8 cache against a bfloat16 one, both computing in bfloat16, mean KL
divergence 0.0029 nats (max 0.021), top-1 agreement 0.98; in float32, int8 against a float32
cache 0.0008 (0.98); for scale, bfloat16 against float32 with float caches 0.0017 (0.96).
"""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.config import EngineConfig
from pyxllm.executor.kv_cache import KVCacheSpec
from pyxllm.kernels import native
from pyxllm.kernels.cpu import fused
from pyxllm.kernels.native.paged_attention import dequantize_kv, quantize_kv

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a forest far away, there lived a",
    "Water boils at 100 degrees Celsius at sea level because",
]
ENGINE = dict(max_model_len=512, kv_cache_memory=0.05)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
needs_fused = pytest.mark.skipif(
    fused.load() is None, reason="PYXLLM_CPU_KERNELS=native: the fused CPU kernels are off"
)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_quantized_row_is_its_int8_values_then_its_float32_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.rand(5, 3, 1, generator=g) * 10
    x[1, 2] = 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert int(rows[..., :64].abs().max()) == 127 and not rows[1, 2].any()
    back = dequantize_kv(rows, torch.float32)
    assert bool(((back - x).abs() <= scale / 2 + 1e-6).all())  # half a step per value
    assert torch.equal(dequantize_kv(x.bfloat16(), torch.float32), x.bfloat16().float())


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cache_write_and_decode_match_the_reference(dtype):
    """The same bytes in the cache (padding slots skipped), and decode attention over them
    within float rounding (bfloat16: the reference rounds scores and probabilities to it)."""
    g = torch.Generator().manual_seed(1)
    kv_heads, head_dim, block_size, blocks = 3, 64, 16, 12
    caches = [torch.zeros(blocks, block_size, kv_heads, head_dim + 4, dtype=torch.int8)] * 4
    caches = [c.clone() for c in caches]
    key, value = (torch.randn(70, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(blocks * block_size, generator=g)[:70]
    slots[5] = -1
    native.reshape_and_cache(key, value, caches[0], caches[1], slots)
    fused.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    query = torch.randn(2, 9, head_dim, generator=g).to(dtype)
    tables, lens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([50, 33])
    args = (caches[0], caches[1], tables, lens, 50, head_dim**-0.5)
    want = native.paged_attention_decode(query, *args)
    got = fused.paged_attention_decode(query, *args)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_int8_blocks_take_the_bytes_of_their_rows():
    """An int8 block holds head_dim + 4 bytes per row against bfloat16's 2 * head_dim: 1.9x the
    blocks in the same memory for SmolLM2's head_dim 64 (3.8x float32's)."""
    spec = KVCacheSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.int8)
    half = KVCacheSpec(30, 16, 3, 64, torch.bfloat16)
    assert spec.row == 68 and spec.bytes_per_block == 2 * 30 * 16 * 3 * 68
    assert spec.num_blocks_for(2**30) == 2**30 // spec.bytes_per_block
    assert spec.num_blocks_for(2**30) > 1.8 * half.num_blocks_for(2**30)


def test_flag_values():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="^--kv-cache-dtype: .*fp8 has no CPU kernel"):
        EngineConfig(kv_cache_dtype="fp8")


def test_only_backends_that_read_int8_rows_take_the_flag(monkeypatch):
    """The CPU's paged attention reads the int8 rows; Ascend's and flash-attn's kernels read
    float K/V, so the executor refuses ``--kv-cache-dtype int8`` on them at start-up."""
    import importlib
    import sys
    import types

    from pyxllm.attention.torch_paged import TorchPagedAttentionBackend

    flash_attn_stub = types.ModuleType("flash_attn")  # stand-ins: only the classes are read
    flash_attn_stub.flash_attn_varlen_func = flash_attn_stub.flash_attn_with_kvcache = None
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_stub)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    import pyxllm.attention

    names = ("npu", "flash_attn")
    for name in names:  # imported afresh on the stand-ins, and forgotten afterwards
        monkeypatch.delitem(sys.modules, f"pyxllm.attention.{name}", raising=False)
        monkeypatch.delattr(pyxllm.attention, name, raising=False)
    try:
        npu, flash_attn = (importlib.import_module(f"pyxllm.attention.{n}") for n in names)
        assert TorchPagedAttentionBackend.supports_int8_kv_cache
        assert not npu.NPUAttentionBackend.supports_int8_kv_cache
        assert not getattr(flash_attn.FlashAttnBackend, "supports_int8_kv_cache", False)
    finally:
        for name in names:
            sys.modules.pop(f"pyxllm.attention.{name}", None)
            vars(pyxllm.attention).pop(name, None)


@pytest.fixture(scope="module")
def int8_engine():
    return LLM(dtype="float32", kv_cache_dtype="int8", **ENGINE)


def test_outputs_do_not_depend_on_the_prefix_cache_chunks_or_runner(int8_engine):
    """Prefills attend to the K/V as the cache holds them (quantized and back), so a prompt
    computed whole or in chunks scores every position alike (the same float32 log-probabilities)
    and a prefix-cache hit gives the same tokens; so does the graph runner (float32, where the
    paths round alike).

    Not asserted: the tokens of a batch whose prefill is chunked among other sequences'
    decodes. A decode row then shares its step's matmuls with prefill rows, and float32
    ``linear`` takes the small-batch kernel up to 8 rows and BLAS above, which sum in other
    orders: on an AVX2 EPYC one of these prompts then continued differently from token 20 on
    (the int8 cache rounds the difference up)."""
    long = ["Repeat: " + "the cat sat on the warm mat by the door " * 12, *PROMPTS]
    want = tokens(int8_engine.generate(long, GREEDY))
    assert tokens(int8_engine.generate(long, GREEDY)) == want  # from the prefix cache
    assert int8_engine.llm_engine.kv_cache_manager.num_hits > 0
    scored = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    chunked = LLM(
        dtype="float32",
        kv_cache_dtype="int8",
        enable_prefix_cache=False,
        max_tokens_per_batch=32,  # the long prompt over 4 steps
        **ENGINE,
    )
    whole = LLM(dtype="float32", kv_cache_dtype="int8", enable_prefix_cache=False, **ENGINE)
    for prompt in long:
        a, b = (
            llm.generate([prompt], scored)[0].prompt_logprobs_tensor for llm in (whole, chunked)
        )
        assert torch.equal(a, b)
    graph = LLM(dtype="float32", kv_cache_dtype="int8", graph_backend="graph", **ENGINE)
    assert tokens(graph.generate(long, GREEDY)) == want
    stats = int8_engine.llm_engine.stats()
    assert stats["num_kv_blocks_used"] == 0


def test_distributions_stay_close_to_a_bfloat16_cache():
    """Full-vocabulary log-probabilities at every prompt position: int8 against a bfloat16
    cache, both computing in bfloat16 (see the module docstring for the measured figures)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    rows = []
    for kv in ("auto", "int8"):
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, enable_prefix_cache=False, **ENGINE)
        rows.append(torch.cat([o.prompt_logprobs_tensor for o in llm.generate(PROMPTS, params)]))
    base, int8 = rows
    kl = (base.exp() * (base - int8)).sum(-1)
    agreement = (base.argmax(-1) == int8.argmax(-1)).float().mean().item()
    assert kl.mean().item() < 0.01 and agreement >= 0.9, (kl.mean().item(), agreement)
