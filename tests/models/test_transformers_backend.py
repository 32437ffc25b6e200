"""``--model-impl transformers``: transformers' model code on pyxllm's paged attention.

OLMo 2, Granite and GPT-NeoX (no native code in pyxllm), and Mistral, Gemma 3 and Gemma 2 (their
sliding windows and soft caps passed by transformers to the attention function) run on tiny
random float32 checkpoints; greedy
tokens equal transformers' own ``generate``, batched and alone, with prompts prefilled in
chunks and again from the prefix cache; last-position logits agree to 1e-4. Llama gives the
same tokens through both implementations. Models the backend cannot run are refused by name.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.config import EngineConfig
from pyxllm.distributed.parallel_state import tp_state
from pyxllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.transformers_backend import TransformersForCausalLM
from tests.model_fixtures import (
    TRANSFORMERS_HEAD_KINDS,
    TRANSFORMERS_ONLY_KINDS,
    build_checkpoint,
    tiny_config,
)
from tests.models.test_models_parity import PROMPTS, hf_generate, pyxllm_last_logits

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# native kinds run through transformers too, for the options transformers passes to attention:
# Mistral's sliding window, Gemma 3's local and global layers, Gemma 2's soft-capping
NATIVE_KINDS = ("mistral", "gemma3", "gemma2")
# chunks of 8 tokens: every prompt past 8 tokens is prefilled over several steps
LLM_KWARGS = dict(max_model_len=96, kv_cache_memory=0.05, max_tokens_per_batch=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_gguf_tokenizer):
    root = tmp_path_factory.mktemp("transformers_backend")
    kinds = (*TRANSFORMERS_ONLY_KINDS, *TRANSFORMERS_HEAD_KINDS, *NATIVE_KINDS, "llama")
    return {
        kind: build_checkpoint(kind, root / kind, hf_gguf_tokenizer, seed=10 + i)
        for i, kind in enumerate(kinds)
    }


@pytest.mark.parametrize("kind", [*TRANSFORMERS_ONLY_KINDS, *NATIVE_KINDS])
def test_greedy_tokens_and_logits_match_transformers(checkpoints, kind, caplog):
    directory, hf = checkpoints[kind]
    impl = "transformers" if kind in NATIVE_KINDS else "auto"  # auto: no native code for the others
    with caplog.at_level(logging.INFO, logger="pyxllm.executor.model_executor"):
        llm = LLM(model=str(directory), model_impl=impl, **LLM_KWARGS)
    assert isinstance(llm.llm_engine.executor.driver.model, TransformersForCausalLM)
    assert "(transformers implementation)" in caplog.text
    outs = llm.generate(PROMPTS, GREEDY)
    prompt_ids = [o.prompt_token_ids for o in outs]
    want = hf_generate(hf, prompt_ids, NEW_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == want, kind
    assert all(len(set(w)) >= 3 for w in want)  # the random model is not degenerate
    hits = llm.llm_engine.kv_cache_manager.num_hits
    alone = llm.generate(PROMPTS[5], GREEDY)[0]  # from the prefix cache this time
    assert llm.llm_engine.kv_cache_manager.num_hits > hits
    assert list(alone.outputs[0].token_ids) == want[5]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt_ids[5]])).logits[0, -1].float()
    got = pyxllm_last_logits(llm, prompt_ids[5])
    assert ref.std() > 1.0
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", TRANSFORMERS_HEAD_KINDS)
def test_other_heads_give_transformers_greedy_tokens(checkpoints, kind):
    directory, hf = checkpoints[kind]
    outs = LLM(model=str(directory), **LLM_KWARGS).generate(PROMPTS[:4], GREEDY)
    want = hf_generate(hf, [o.prompt_token_ids for o in outs], NEW_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == want, kind


def test_llama_gives_the_same_tokens_through_both_implementations(checkpoints):
    """...and through the graph runner (decode steps traced with TorchScript on the CPU)."""
    directory, _ = checkpoints["llama"]
    results = {}
    for impl, runner in (("pyxllm", "eager"), ("transformers", "eager"), ("transformers", "graph")):
        llm = LLM(model=str(directory), model_impl=impl, graph_backend=runner, **LLM_KWARGS)
        model = llm.llm_engine.executor.driver.model
        assert isinstance(model, TransformersForCausalLM) == (impl == "transformers")
        outs = llm.generate(PROMPTS, GREEDY)
        results[impl, runner] = [list(o.outputs[0].token_ids) for o in outs]
    assert len(set(map(str, results.values()))) == 1, results


def test_quantization_applies_to_the_transformers_linear_layers(checkpoints):
    directory, hf = checkpoints["olmo2"]
    llm = LLM(model=str(directory), quantization="int8", **LLM_KWARGS)
    model = llm.llm_engine.executor.driver.model
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LinearBase) and q_proj.qweight.dtype == torch.int8
    ids = llm.get_tokenizer().encode(PROMPTS[5])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    got = pyxllm_last_logits(llm, ids)
    assert not torch.allclose(got, ref, atol=1e-4)  # quantized, so not the float32 logits
    assert torch.corrcoef(torch.stack([got, ref]))[0, 1] > 0.99  # but close to them


def test_model_impl_flag_values():
    assert EngineConfig(model_impl="python").model_impl == "pyxllm"  # xLLM's name
    with pytest.raises(ValueError, match="--model-impl: must be one of auto, pyxllm, transformers"):
        EngineConfig(model_impl="vllm")


def test_architectures_no_implementation_runs_are_refused_by_name():
    olmo2 = tiny_config("olmo2", architectures=["Olmo2ForCausalLM"])
    with pytest.raises(
        ValueError, match=r"Olmo2ForCausalLM.*--model-impl transformers runs others"
    ):
        resolve_model_class(olmo2, "cpu", "pyxllm")
    from transformers import MambaConfig

    mamba = MambaConfig(architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match=r"MambaForCausalLM does not route its attention"):
        resolve_model_class(mamba, "cpu", "transformers")
    with pytest.raises(ValueError, match=r"unsupported model architecture FooForCausalLM.*"
                       r"has no model class FooForCausalLM"):  # fmt: skip
        resolve_model_class(SimpleNamespace(architectures=["FooForCausalLM"]), "cpu")


def test_tensor_parallel_splits_the_tp_plan_layers_and_refuses_other_plans():
    config = tiny_config("granite")
    assert config.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    with tp_state(0, 2), torch.device("meta"):
        model = TransformersForCausalLM(config)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is ColumnParallelLinear
    assert layer.self_attn.q_proj.weight.shape == (32, 64)  # half of 4 heads x 16
    assert type(layer.self_attn.o_proj) is RowParallelLinear
    assert type(layer.mlp.down_proj) is RowParallelLinear
    assert model.attn_layers[0].num_kv_heads == 1  # 2 KV heads over 2 ranks
    olmo2 = tiny_config("olmo2")  # q/k norms over whole projections: gathered outputs
    with (
        tp_state(0, 2),
        torch.device("meta"),
        pytest.raises(
            ValueError, match=r"splits layers.0.self_attn.q_proj as colwise_gather_output"
        ),
    ):
        TransformersForCausalLM(olmo2)
    config.base_model_tp_plan = None
    with tp_state(0, 2), torch.device("meta"), pytest.raises(ValueError, match="no TP plan"):
        TransformersForCausalLM(config)
