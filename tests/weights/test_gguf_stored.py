"""``--quantization gguf``, the default for a GGUF file: its weights kept as stored, on the grouped
int4/int8 kernels, against the same file dequantized (``--quantization none``).

- The embedded default model (Q4_1 decoder weights, a Q8_0 tied embedding): the decoder's
  layers hold int4 groups, the LM head and the embedding int8 groups, the embedding's rows are
  gguf-py's values exactly, and the prompt log-probabilities stay within 0.05 of the
  dequantized model's (measured: max 0.015, mean 0.0019, on log-probabilities of std 3.6)
  with the same top token at every position and the same greedy text.
- A tiny llama written here in every type the kernels take (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
  Q6_K, Q8_0, Q2_K, Q3_K, IQ4_NL, IQ4_XS) and a float32 tensor: each layer takes the format its
  pieces allow (a fused layer of int4 and int8 pieces as int8, in groups of 16 with a Q6_K,
  Q3_K or Q2_K piece; a float piece dequantized), and generates the dequantized file's greedy
  tokens.
- What ``auto`` resolves to, and its override.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pyxllm import LLM, SamplingParams, kernels
from pyxllm.config import EngineConfig
from pyxllm.kernels.cpu import fused
from pyxllm.layers.quantization import DEFAULT_ENV, resolve_quantization
from pyxllm.layers.quantization.stored import GroupedLinearMethod, SplitGroupedLinearMethod
from pyxllm.weights.gguf_reader import open_gguf
from tests.model_fixtures import build_hf_model, tiny_config
from tests.weights.test_gguf_models import write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

# the tests of the fused CPU pack's layouts (super-block scales, float16 pairs, row readers)
FUSED_LAYOUT = pytest.mark.skipif(
    fused.load() is None, reason="PYXLLM_CPU_KERNELS=native: the fused CPU kernels are off"
)

PROMPTS = ["The capital of France is", "Write a poem about the sea.", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KWARGS = dict(dtype="float32", max_model_len=128, kv_cache_memory=0.05)


def _model(llm: LLM):
    return llm.llm_engine.executor.driver.model


def _format(layer) -> str:
    method = layer.quant_method
    if isinstance(method, SplitGroupedLinearMethod):
        return method.format
    if not isinstance(method, GroupedLinearMethod):
        return "float"
    return method.format + ("" if method.group_size == 32 else f"/{method.group_size}")


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Float32 log-probabilities of the whole vocabulary at every prompt position, through the
    engine's own path."""
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=-1))
    return torch.cat([o.prompt_logprobs_tensor for o in out])


def test_auto_keeps_a_gguf_file_as_stored_and_other_checkpoints_in_dtype(monkeypatch):
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    assert EngineConfig().quantization == "auto"
    assert resolve_quantization("auto", "gguf") == "gguf"
    assert resolve_quantization("auto", "hf") is None
    assert resolve_quantization(None, "gguf") is None
    assert resolve_quantization("int4", "gguf") == "int4"
    monkeypatch.setenv(DEFAULT_ENV, "none")
    assert resolve_quantization("auto", "gguf") is None
    monkeypatch.setenv(DEFAULT_ENV, "gguf")
    assert resolve_quantization("auto", "hf") is None
    monkeypatch.setenv(DEFAULT_ENV, "int3")
    with pytest.raises(ValueError, match=DEFAULT_ENV):
        resolve_quantization("auto", "gguf")
    with pytest.raises(ValueError, match="--quantization gguf"):
        resolve_quantization("gguf", "hf")
    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig(quantization="q4")


@pytest.fixture(scope="module")
def default_pair():
    """The default model dequantized, and with its weights as stored."""
    return LLM(quantization="none", **KWARGS), LLM(quantization="gguf", **KWARGS)


def test_default_model_runs_on_its_stored_blocks(default_pair, default_gguf_path):
    _, stored = default_pair
    model = _model(stored)
    layer = model.model.layers[0]
    assert {_format(layer.self_attn.qkv_proj), _format(layer.mlp.down_proj)} == {"int4"}
    assert _format(model.lm_head) == "int8"  # the tied Q8_0 embedding
    assert not hasattr(layer.mlp.down_proj, "weight")
    embedding = model.model.embed_tokens
    # the tied embedding reads the LM head's packed groups: the weight is held once
    assert embedding.stored_lookup.packed is model.lm_head.qweight
    ids = torch.tensor([0, 1, 17, 49151])
    gguf = open_gguf(default_gguf_path)
    info = gguf.tensor_by_name["token_embd.weight"]
    assert info.ggml_type == T.Q8_0
    want = np.stack([gguf.read_region(info, (i, i + 1), (0, info.shape[1]))[0] for i in ids])
    assert torch.equal(embedding(ids), torch.from_numpy(want))


def test_default_model_logprobs_and_greedy_text_match_the_dequantized_file(default_pair):
    dequantized, stored = default_pair
    want, got = _prompt_logprobs(dequantized), _prompt_logprobs(stored)
    diff = (got - want).abs()
    assert diff.max().item() < 0.05 and diff.mean().item() < 0.01, diff.max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    texts = [o.outputs[0].token_ids for o in stored.generate(PROMPTS, GREEDY)]
    assert texts == [o.outputs[0].token_ids for o in dequantized.generate(PROMPTS, GREEDY)]


# ------------------------------------------------------------------ a tiny llama of every type

# llama.cpp's tensor names for a llama layer, and the type each layer's piece is written in
_LAYER_TYPES = [  # a name left out stays float32
    {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.IQ4_XS,
     "ffn_gate": T.Q4_K, "ffn_up": T.Q2_K},
    {"attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.IQ4_NL, "attn_output": T.Q4_K,
     "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q3_K},
    {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q4_0},
]  # fmt: skip
# the format each fused layer must end in: all int4 pieces -> int4, all int8 -> int8 (groups of
# 16 with a Q6_K, Q3_K or Q2_K piece), a mix -> each run in its own, any float piece -> float
_EXPECTED = [
    {
        "qkv_proj": "int4+int8/16",
        "o_proj": "int8",
        "gate_up_proj": "int4+int8/16",
        "down_proj": "float",
    },
    {"qkv_proj": "int8", "o_proj": "int4", "gate_up_proj": "int4", "down_proj": "int8/16"},
    {"qkv_proj": "int8", "o_proj": "int8", "gate_up_proj": "int4", "down_proj": "int4"},
]
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` of a q/k weight: each head's half-split rotary rows
    interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_gguf(model, path, tied: bool = False, layer_types: list[dict] | None = None):
    """``model`` (a transformers llama, 256-wide so K-quants' 256-value blocks fit) written as
    llama.cpp's converter does, each layer's projections in :data:`_LAYER_TYPES`, the embedding
    Q8_0 and the LM head Q6_K, as llama.cpp's quantizer writes it (no vocabulary: pass a
    tokenizer with ``tokenizer=``); ``tied``: no LM head, the embedding Q6_K (a tied model's
    Q4_K_M file); ``layer_types``: each layer's types instead of :data:`_LAYER_TYPES`'."""
    layer_types = layer_types or _LAYER_TYPES
    config = model.config
    metadata = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "block_count": config.num_hidden_layers,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.dimension_count": config.hidden_size // config.num_attention_heads,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    }
    tensors = {"token_embd.weight": model.model.embed_tokens.weight}
    tensors["output_norm.weight"] = model.model.norm.weight
    types = {"token_embd.weight": T.Q6_K if tied else T.Q8_0}
    if not tied:
        tensors["output.weight"] = model.lm_head.weight
        types["output.weight"] = T.Q6_K
    for i, layer in enumerate(model.model.layers):
        for hf, name in _HF_TO_GGUF.items():
            weight = layer.get_submodule(hf).weight
            if name == "attn_q":
                weight = _permute(weight, config.num_attention_heads)
            elif name == "attn_k":
                weight = _permute(weight, config.num_key_value_heads)
            tensors[f"blk.{i}.{name}.weight"] = weight
            if name in layer_types[i]:
                types[f"blk.{i}.{name}.weight"] = layer_types[i][name]
    return write_gguf(path, "llama", metadata, tensors, types)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, hf_gguf_tokenizer):
    root = tmp_path_factory.mktemp("stored_gguf")
    config = tiny_config("llama", hidden_size=256)
    config.num_hidden_layers = len(_LAYER_TYPES)
    config.intermediate_size = 512
    model = build_hf_model(config, seed=3)
    hf_gguf_tokenizer.save_pretrained(root / "tokenizer")
    path = llama_gguf(model, root / "tiny-llama-mixed.gguf")
    kwargs = dict(model=str(path), tokenizer=str(root / "tokenizer"), **KWARGS)
    return LLM(quantization="none", **kwargs), LLM(quantization="gguf", **kwargs), kwargs


def test_each_layer_takes_the_format_its_pieces_allow(tiny_llama):
    _, stored, _ = tiny_llama
    model = _model(stored)
    assert len(model.model.layers) == len(_EXPECTED)
    for layer, expected in zip(model.model.layers, _EXPECTED):
        got = {
            name.rpartition(".")[2]: _format(module)
            for name, module in layer.named_modules()
            if name.rpartition(".")[2] in expected
        }
        assert got == expected
    assert _format(model.lm_head) == "int8/16"
    assert model.model.embed_tokens.stored_lookup is not None


# the (layer, module, run) whose scales the file factors in super-blocks of 256 (runs of
# K-quants or IQ4_XS); the other runs hold (scale, low) pairs (a Q4_0 mixed in, Q5_0, Q8_0 ...)
_SUPER_BLOCK_RUNS = {
    (0, "qkv_proj", 1), (0, "o_proj", None), (0, "gate_up_proj", 0), (0, "gate_up_proj", 1),
    (1, "o_proj", None), (1, "down_proj", None), (2, "o_proj", None),
}  # fmt: skip


@FUSED_LAYOUT
def test_k_quant_layers_keep_the_files_super_block_scales(tiny_llama):
    """A run of K-quant pieces (and IQ4_XS) keeps its scales as the file factors them (a float16
    ``d`` per 256 inputs, an int8 per group: ~0.08 byte a weight, exact), the others pairs;
    every row read back from the packed tiles is the dequantized file's, bit for bit."""
    dequantized, stored, _ = tiny_llama
    model, want = _model(stored), _model(dequantized)
    for i, layer in enumerate(model.model.layers):
        for name in _EXPECTED[i]:
            module = next(m for n, m in layer.named_modules() if n.endswith(name))
            weight = next(
                m for n, m in want.model.layers[i].named_modules() if n.endswith(name)
            ).weight
            method = module.quant_method
            if isinstance(method, SplitGroupedLinearMethod):
                runs = [(r, m, f"_{r}") for r, (m, _) in enumerate(method.parts)]
            elif isinstance(method, GroupedLinearMethod):
                runs = [(None, method, "")]
            else:
                continue
            start = 0
            for run, part, suffix in runs:
                qweight = getattr(module, "qweight" + suffix)
                scales = getattr(module, "scales_and_zeros" + suffix)
                factored = (i, name, run) in _SUPER_BLOCK_RUNS
                assert (scales.dtype == torch.uint8) == factored, (i, name, run, scales.dtype)
                rows = qweight.shape[0] * 16
                if factored:  # 0.08 byte a weight, 0.14 in groups of 16 with lows (Q2_K)
                    assert scales.numel() <= 0.15 * rows * weight.shape[1], (i, name, run)
                ops = kernels.ops
                read = ops.int4_rows if part.format == "int4" else ops.int8_group_rows
                got = read(qweight, scales, torch.arange(rows), part.group_size)
                assert torch.equal(got, weight[start : start + rows]), (i, name, run)
                start += rows
    assert model.lm_head.scales_and_zeros.dtype == torch.uint8  # Q6_K


def _scale_buffers(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: b for n, b in _model(llm).named_buffers() if "scales_and_zeros" in n}


@FUSED_LAYOUT
def test_bfloat16_holds_the_files_scales_as_float32_does(tiny_llama):
    """The compute dtype does not round a file's scales: in bfloat16 every run holds the scales
    it holds in float32 wherever those are the file's float16 numbers (Q4_0, Q4_1, Q5_x and
    Q8_0 pairs) or factored (the K-quants), so its rows are the file's values bit for bit as
    in float32 (the test above); only pairs that float16 cannot hold (a K-quant run that falls
    back to pairs) take the compute dtype. Pairs rounded to bfloat16 first had changed a Q4_1
    scale 0.1268 to 0.1270."""
    _, stored, kwargs = tiny_llama
    bf16 = LLM(quantization="gguf", **{**kwargs, "dtype": "bfloat16"})
    want, got = _scale_buffers(stored), _scale_buffers(bf16)
    assert want.keys() == got.keys()
    exact = {n for n, b in want.items() if b.dtype in (torch.float16, torch.uint8)}
    assert any(want[n].dtype == torch.float16 for n in exact)
    for name, scales in got.items():
        if name in exact:
            assert scales.dtype == want[name].dtype and torch.equal(scales, want[name]), name
        else:
            assert scales.dtype == torch.bfloat16, (name, scales.dtype)
    texts = bf16.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in texts)


@FUSED_LAYOUT
def test_a_tied_q6_k_embedding_reads_its_rows_from_the_heads_super_block_tiles(
    tmp_path, hf_gguf_tokenizer
):
    """A tied model whose embedding is Q6_K (its head too): the lookup reads the head's packed
    tiles and their super-block scales, through the graph runner's captured steps, and the
    model generates the dequantized file's greedy tokens."""
    config = tiny_config("llama", hidden_size=256)
    config.num_hidden_layers, config.intermediate_size = 1, 512
    config.tie_word_embeddings = True
    model = build_hf_model(config, seed=5)
    hf_gguf_tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = llama_gguf(model, tmp_path / "tiny-llama-tied.gguf", tied=True)
    kwargs = dict(model=str(path), tokenizer=str(tmp_path / "tokenizer"), **KWARGS)
    dequantized = LLM(quantization="none", **kwargs)
    stored = LLM(quantization="gguf", graph_backend="graph", **kwargs)
    head = _model(stored).lm_head
    assert head.scales_and_zeros.dtype == torch.uint8
    lookup = _model(stored).model.embed_tokens.stored_lookup
    assert lookup.packed is head.qweight and lookup.scales_and_zeros is head.scales_and_zeros
    want, got = _prompt_logprobs(dequantized), _prompt_logprobs(stored)
    assert (got - want).abs().max().item() < 2e-3 * want.abs().max().item()
    texts = [o.outputs[0].token_ids for o in stored.generate(PROMPTS, GREEDY)]
    assert texts == [o.outputs[0].token_ids for o in dequantized.generate(PROMPTS, GREEDY)]
    assert sum(stored.llm_engine.executor.driver.runner.replays.values()) > 0  # captured steps


def test_mixed_types_generate_the_dequantized_files_tokens(tiny_llama):
    dequantized, stored, _ = tiny_llama
    want, got = _prompt_logprobs(dequantized), _prompt_logprobs(stored)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 2e-3 * scale
    texts = [o.outputs[0].token_ids for o in stored.generate(PROMPTS, GREEDY)]
    assert texts == [o.outputs[0].token_ids for o in dequantized.generate(PROMPTS, GREEDY)]
    assert len({tuple(t) for t in texts}) == len(PROMPTS)


@FUSED_LAYOUT
def test_int4_keeps_the_files_int4_layers_and_quantizes_the_rest(tiny_llama):
    """``--quantization int4`` on a GGUF file: a layer the file stores in int4 blocks (Q4_0,
    Q4_1, Q4_K) keeps them, so its weights are the file's values, not rounded a second time;
    the others are quantized to int4 from their dequantized values."""
    dequantized, _, kwargs = tiny_llama
    model = _model(LLM(quantization="int4", **kwargs))
    want = _model(dequantized)
    for i, (layer, expected) in enumerate(zip(model.model.layers, _EXPECTED)):
        for name, fmt in expected.items():
            module = next(m for n, m in layer.named_modules() if n.endswith(name))
            if fmt != "int4":
                assert type(module.quant_method).__name__ == "Int4LinearMethod", (i, name)
                continue
            assert _format(module) == "int4", (i, name)
            weight = next(m for n, m in want.model.layers[i].named_modules() if n.endswith(name))
            ids = torch.arange(weight.weight.shape[0])
            rows = kernels.ops.int4_rows(module.qweight, module.scales_and_zeros, ids, 32)
            torch.testing.assert_close(rows, weight.weight, rtol=1e-6, atol=1e-7)
