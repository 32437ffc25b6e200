"""Phi-3 beyond the shared parity tests: LongRoPE's long factors, and fused checkpoint tensors.

The parity tests (``test_models_parity.py``, kind ``phi3``) run within
``original_max_position_embeddings``, on the short factors. Here a tiny Phi-3 with
``original_max_position_embeddings`` 32 runs prompts longer than 32 tokens with
``--max-model-len`` 96 (long factors, as transformers takes them past 32 positions), and short
prompts with ``--max-model-len`` 32 (short factors, as transformers). Fused ``qkv_proj`` and
``gate_up_proj`` tensors split by TP rank as their separate pieces would.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pyxllm import LLM
from pyxllm.distributed.parallel_state import tp_state
from pyxllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tests.model_fixtures import build_hf_model, save_checkpoint, tiny_config
from tests.models.test_models_parity import GREEDY, hf_generate, pyxllm_last_logits

ORIGINAL = 32  # original_max_position_embeddings: shorter than the long prompts
LONG_PROMPTS = [
    "Once upon a time there was a little fox who lived at the edge of a very large forest, "
    "and every morning it walked down to the river to drink and to watch the fish jump",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28",
]
SHORT_PROMPTS = ["Hello", "The capital of France is"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, hf_gguf_tokenizer):
    """(checkpoint dir, transformers model) of a tiny Phi-3 with original context 32."""
    model = build_hf_model(tiny_config("phi3", original_max_position_embeddings=ORIGINAL), seed=5)
    return save_checkpoint(
        model, tmp_path_factory.mktemp("phi3") / "phi3", hf_gguf_tokenizer
    ), model


def test_checkpoint_has_fused_projections(phi3):
    names = load_file(phi3[0] / "model.safetensors").keys()
    fused = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}
    assert fused <= names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)


def test_prompts_past_the_original_context_use_the_long_factors_like_transformers(phi3):
    directory, hf = phi3
    llm = LLM(model=str(directory), max_model_len=96, kv_cache_memory=0.05)
    outs = llm.generate(LONG_PROMPTS, GREEDY)
    prompt_ids = [o.prompt_token_ids for o in outs]
    assert all(len(ids) > ORIGINAL for ids in prompt_ids)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_generate(hf, prompt_ids)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt_ids[0]])).logits[0, -1]
    torch.testing.assert_close(pyxllm_last_logits(llm, prompt_ids[0]), ref, atol=1e-4, rtol=0)


def test_a_context_within_the_original_one_uses_the_short_factors_like_transformers(phi3):
    directory, hf = phi3
    llm = LLM(model=str(directory), max_model_len=ORIGINAL, kv_cache_memory=0.05)
    outs = llm.generate(SHORT_PROMPTS, GREEDY)
    prompt_ids = [o.prompt_token_ids for o in outs]
    assert all(len(ids) + GREEDY.max_tokens <= ORIGINAL for ids in prompt_ids)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_generate(hf, prompt_ids)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_qkv_loads_as_its_pieces_would(tp):
    """4 query heads, 2 KV heads: at tp 4 each KV head is replicated on 2 ranks."""
    head_dim, hidden = 8, 16
    q, k, v = torch.randn(32, hidden), torch.randn(16, hidden), torch.randn(16, hidden)
    for rank in range(tp):
        with tp_state(rank, tp):
            fused, pieces = (QKVParallelLinear(hidden, head_dim, 4, 2) for _ in range(2))
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        for shard, full in (("q", q), ("k", k), ("v", v)):
            pieces.weight_loader(pieces.weight, full, shard)
        assert torch.equal(fused.weight, pieces.weight), rank
    with pytest.raises(ValueError, match=r"fused checkpoint shape \(63, 16\).*64 rows"):
        fused.weight_loader(fused.weight, torch.randn(63, hidden))


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_gate_up_loads_as_its_pieces_would(tp):
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    for rank in range(tp):
        with tp_state(rank, tp):
            fused, pieces = (MergedColumnParallelLinear(8, [12, 12]) for _ in range(2))
        fused.weight_loader(fused.weight, torch.cat([gate, up]))
        pieces.weight_loader(pieces.weight, gate, 0)
        pieces.weight_loader(pieces.weight, up, 1)
        assert torch.equal(fused.weight, pieces.weight), rank
        half = slice(rank * 12 // tp, (rank + 1) * 12 // tp)
        assert torch.equal(fused.weight[: 12 // tp], gate[half])
