"""Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Qwen2 with a sliding window, Phi-3 (LongRoPE, partial
rotary, a window), Gemma 3 and Gemma 2 on tiny random checkpoints: pyxllm equals transformers.

Each architecture is saved by transformers (float32 safetensors, the SmolLM2 tokenizer beside it)
and run by ``pyxllm.LLM``; greedy tokens must equal ``generate(do_sample=False)`` and the last
position's logits must agree to 1e-4. Also: checkpoint errors name the tensor, unsupported
architectures are named, ``--dtype auto`` follows the checkpoint, and MoE experts split by TP rank
sum to the unsplit result.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from pyxllm import LLM, SamplingParams
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.model_executor import resolve_dtype
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.layers.forward_context import ForwardContext, set_forward_context
from pyxllm.models.registry import resolve_model_class
from pyxllm.platforms import cpu
from tests.model_fixtures import build_checkpoint

KINDS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "qwen2_sliding",
    "phi3",
    "gemma3",
    "gemma2",
)
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    "Hello",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "def fibonacci(n):\n    return",
    "a",
    "Once upon a time there was a little fox who lived at the edge of a very large forest",
    "Q: why is the sky blue?\nA:",
    "Ünïcödé 🙂",
]
LLM_KWARGS = dict(max_model_len=96, kv_cache_memory=0.05)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_gguf_tokenizer):
    """kind -> (checkpoint dir, transformers reference model); qwen2 is sharded (index json)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        kind: build_checkpoint(
            kind,
            root / kind,
            hf_gguf_tokenizer,
            seed=i,
            max_shard_size="5MB" if kind == "qwen2" else None,
        )
        for i, kind in enumerate(KINDS)
    }


@pytest.fixture(scope="module", params=KINDS)
def case(request, checkpoints):
    directory, hf_model = checkpoints[request.param]
    llm = LLM(model=str(directory), **LLM_KWARGS)
    return SimpleNamespace(kind=request.param, dir=directory, hf=hf_model, llm=llm)


def hf_generate(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuations, one ``generate`` call per prompt (no padding); EOS
    unset so that, like ``ignore_eos``, generation runs on past it (``min_new_tokens`` would
    instead forbid EOS)."""
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
    )
    outs = []
    for ids in prompts:
        inputs = torch.tensor([ids])
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), generation_config=config
        )
        assert out.shape[1] == len(ids) + new_tokens
        outs.append(out[0, len(ids) :].tolist())
    return outs


@torch.inference_mode()
def pyxllm_last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits ``[vocab]`` float32 after the last token of ``ids``, one prefill step through the
    executor."""
    executor = llm.llm_engine.executor.driver
    block_size = executor.config.block_size
    seq = ScheduledSequence(
        "logits", list(ids), 0, list(range(-(-len(ids) // block_size))), True, GREEDY
    )
    batch = InputBatch.build(SchedulerOutput([seq]), block_size, executor.device)
    with set_forward_context(
        ForwardContext(executor.attn_backend.build(batch), executor.kv_caches)
    ):
        hidden = executor.runner(batch.input_ids, batch.positions)
    return executor.model.compute_logits(hidden.index_select(0, batch.logits_indices))[0]


def test_checkpoints_have_the_intended_shapes(checkpoints):
    qwen2_dir = checkpoints["qwen2"][0]
    assert (qwen2_dir / "model.safetensors.index.json").is_file()
    assert len(list(qwen2_dir.glob("*.safetensors"))) >= 2
    qwen3 = json.loads((checkpoints["qwen3"][0] / "config.json").read_text())
    assert qwen3["head_dim"] != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    assert not qwen3["tie_word_embeddings"]
    assert json.loads((qwen2_dir / "config.json").read_text())["tie_word_embeddings"]
    moe_names = load_file(checkpoints["qwen3_moe"][0] / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in moe_names
    assert "model.layers.1.mlp.gate_proj.weight" in moe_names  # mlp_only_layers=[1]: dense


def test_greedy_batch_matches_transformers(case):
    outs = case.llm.generate(PROMPTS, GREEDY)
    prompt_ids = [o.prompt_token_ids for o in outs]
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_generate(case.hf, prompt_ids), case.kind
    assert len({len(p) for p in prompt_ids}) >= 5
    # the random model is not degenerate: continuations vary within and across prompts
    assert all(len(set(g)) >= 4 for g in got), got
    assert len({tuple(g) for g in got}) == len(got)


def test_last_logits_match_transformers(case):
    ids = case.llm.get_tokenizer().encode(PROMPTS[5])
    with torch.no_grad():
        ref = case.hf(torch.tensor([ids])).logits[0, -1].float()
    got = pyxllm_last_logits(case.llm, ids)
    assert got.shape == ref.shape == (case.hf.config.vocab_size,)
    assert ref.std() > 1.0  # logits spread out: a broken layer shows up
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named_with_the_supported_ones(checkpoints, tmp_path):
    directory = _copy_checkpoint(checkpoints["llama"][0], tmp_path / "foo")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(model=str(directory), **LLM_KWARGS)
    message = str(e.value)
    assert "FooBarForCausalLM" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in message


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_unsupported_attention_layer_types_are_refused(arch):
    config = SimpleNamespace(
        architectures=[arch],
        layer_types=["sliding_attention"] + 5 * ["chunked_attention"],
        sliding_window=4,
    )
    with pytest.raises(ValueError, match=r"'chunked_attention' \(layers \[1, 2, 3, 4\]…\)"):
        resolve_model_class(config, "cpu")(config)  # before any layer is built


@pytest.mark.parametrize(
    "kind, edit, named",
    [
        ("llama", "extra", "model.layers.0.mlp.extra_proj.weight"),
        (
            "llama",
            "missing",
            "model.layers.1.self_attn.k_proj.weight",
        ),  # one piece of the fused QKV
        ("qwen3", "missing", "model.layers.0.self_attn.q_norm.weight"),
        ("qwen3_moe", "missing", "model.layers.2.mlp.experts.3.up_proj.weight"),  # one piece of w13
        (
            "qwen3_moe",
            "extra",
            "model.layers.0.mlp.experts.4.down_proj.weight",
        ),  # expert id past num_experts
    ],
)
def test_checkpoint_tensor_errors_name_the_tensor(checkpoints, tmp_path, kind, edit, named):
    directory = _copy_checkpoint(checkpoints[kind][0], tmp_path / kind)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    if edit == "extra":
        tensors[named] = torch.zeros(64, 32)
    else:
        del tensors[named]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        LLM(model=str(directory), **LLM_KWARGS)


def test_dtype_auto_follows_a_bfloat16_checkpoint(tmp_path, hf_gguf_tokenizer):
    directory, _ = build_checkpoint(
        "qwen3_moe", tmp_path / "bf16", hf_gguf_tokenizer, dtype=torch.bfloat16
    )
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    llm = LLM(model=str(directory), **LLM_KWARGS)
    executor = llm.llm_engine.executor.driver
    assert executor.dtype == torch.bfloat16
    assert {p.dtype for p in executor.model.parameters()} == {torch.bfloat16}
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert (
        LLM(model=str(directory), dtype="float32", **LLM_KWARGS).llm_engine.executor.dtype
        == torch.float32
    )


@pytest.mark.parametrize(
    "declared, expected",
    [
        ("float16", torch.bfloat16),
        (torch.float16, torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (torch.float32, torch.float32),
        (None, torch.float32),
    ],
)
def test_resolve_dtype_auto_on_cpu(declared, expected):
    assert resolve_dtype("auto", cpu.load(), SimpleNamespace(dtype=declared)) == expected
    assert resolve_dtype("float32", cpu.load(), SimpleNamespace(dtype=declared)) == torch.float32
    assert (
        resolve_dtype("float16", cpu.load(), SimpleNamespace(dtype=declared)) == torch.bfloat16
    )  # as vLLM


def test_tp_split_experts_sum_to_the_unsplit_moe(monkeypatch):
    """Each TP rank loads a slice of moe_intermediate for every expert; the ranks' partial outputs
    sum to the tp=1 result, which equals a dense per-token reference."""
    from pyxllm.distributed import parallel_state
    from pyxllm.kernels.native import fused_moe, fused_topk
    from pyxllm.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    experts, hidden, inter, top_k, tokens = 4, 16, 8, 2, 7
    gate = [torch.randn(inter, hidden) for _ in range(experts)]
    up = [torch.randn(inter, hidden) for _ in range(experts)]
    down = [torch.randn(hidden, inter) for _ in range(experts)]
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    weights, ids = fused_topk(logits, top_k, renormalize=True)

    def rank_output(rank: int, size: int) -> torch.Tensor:
        monkeypatch.setattr(
            parallel_state, "_TP", parallel_state._TPState(rank=rank, world_size=size)
        )
        layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
        for e in range(experts):
            layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
            layer.weight_loader(layer.w13_weight, up[e], "w3", e)
            layer.weight_loader(layer.w2_weight, down[e], "w2", e)
        assert layer.w13_weight.shape == (experts, 2 * inter // size, hidden)
        return fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)

    full = rank_output(0, 1)
    torch.testing.assert_close(rank_output(0, 2) + rank_output(1, 2), full, atol=1e-4, rtol=1e-5)
    dense = torch.zeros(tokens, experts).scatter(1, ids, weights)
    reference = sum(
        dense[:, e : e + 1]
        * ((torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T)
        for e in range(experts)
    )
    torch.testing.assert_close(full, reference, atol=1e-4, rtol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens)) and ids.shape == (tokens, top_k)
