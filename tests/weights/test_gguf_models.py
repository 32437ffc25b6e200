"""GGUF files of the native architectures, written here with the ``gguf`` package's writer.

:func:`write_gguf` writes any architecture's file (float32 tensors, metadata by llama.cpp's key
names); each architecture's test converts a tiny random transformers checkpoint the way
llama.cpp's ``convert_hf_to_gguf.py`` does, then checks that pyxllm reads back its config and
runs it to the same greedy tokens as the safetensors checkpoint.

- phi3 (``Phi3MiniModel``): fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows),
  ``rope.dimension_count`` the rotary width (a partial rotary factor), ``attention.sliding_window``
  (0: none), and LongRoPE's factors as the tensors ``rope_factors_long``/``rope_factors_short``
  with ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``.
- gemma2, gemma3 (``Gemma2Model``, ``Gemma3Model``): every norm stored as ``1 + w``, Gemma's
  four norms per layer (``attn_norm``, ``post_attention_norm``, ``ffn_norm``, ``post_ffw_norm``),
  ``attention.sliding_window``, the soft caps the config sets, the global RoPE theta only; the
  local/global pattern, the local theta and ``query_pre_attn_scalar`` are llama.cpp's fixed ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.weights import load_model_config
from tests.model_fixtures import build_hf_model, save_checkpoint, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time there was a little fox who lived at the edge of a very large forest",
]
LLM_KWARGS = dict(max_model_len=96, kv_cache_memory=0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, Any],
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write a GGUF file of ``arch`` (``general.architecture``) and return ``path``.

    ``metadata``: keys without the ``{arch}.`` prefix (``"block_count"``,
    ``"attention.head_count"``, ...), except those starting with ``general.`` or
    ``tokenizer.``, which are written as given. Values: ``bool``, ``int`` (uint32), ``float``
    (float32), ``str`` or a list (an array). ``tensors``: GGUF name -> array or tensor, written
    as float32 in torch's shape order (the writer reverses it, as llama.cpp's converter does),
    or quantized to the type ``types`` names for it (``gguf_quantize.quantize_rows``; a uint8
    array of whole rows of blocks, whose element shape the writer derives).
    """
    from tests.gguf_quantize import quantize_rows

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, array in tensors.items():
        if isinstance(array, torch.Tensor):
            array = array.detach().float().numpy()
        array = np.ascontiguousarray(array, dtype=np.float32)
        ggml_type = (types or {}).get(name)
        if ggml_type is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize_rows(array, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


# ---------------------------------------------------------------- phi3

# Hugging Face name (after ``model.layers.{i}.``) -> llama.cpp's, as Phi3MiniModel writes them
_PHI3_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_PHI3_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def phi3_gguf(model, path: Path) -> Path:
    """Convert a transformers Phi-3 as llama.cpp's ``Phi3MiniModel`` does (no vocabulary: pass
    the checkpoint's tokenizer with ``tokenizer=``)."""
    config = model.config
    rope = config.rope_parameters
    heads, hidden = config.num_attention_heads, config.hidden_size
    original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
    scale = config.max_position_embeddings / original
    metadata = {
        "context_length": config.max_position_embeddings,
        "rope.scaling.original_context_length": original,
        "embedding_length": hidden,
        "feed_forward_length": config.intermediate_size,
        "block_count": config.num_hidden_layers,
        "attention.head_count": heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.dimension_count": int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.sliding_window": config.sliding_window or 0,
        "vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    }
    tensors: dict[str, Any] = {}
    if rope.get("long_factor"):
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        metadata["rope.scaling.attn_factor"] = attn
        tensors["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
        tensors["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
    for name, tensor in model.state_dict().items():
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            layer, _, part = base.removeprefix("model.layers.").partition(".")
            tensors[f"blk.{layer}.{_PHI3_LAYER[part]}.{suffix}"] = tensor
        elif not (base == "lm_head" and config.tie_word_embeddings):
            tensors[f"{_PHI3_TOP[base]}.{suffix}"] = tensor
    return write_gguf(path, "phi3", metadata, tensors)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, hf_gguf_tokenizer):
    """(safetensors dir, GGUF path, transformers model): LongRoPE past 32 positions, so
    ``max_model_len`` 96 runs the long factors."""
    root = tmp_path_factory.mktemp("phi3_gguf")
    model = build_hf_model(tiny_config("phi3", original_max_position_embeddings=32), seed=7)
    directory = save_checkpoint(model, root / "hf", hf_gguf_tokenizer)
    return directory, phi3_gguf(model, root / "tiny-phi3.gguf"), model


def test_phi3_gguf_config_matches_the_checkpoint(phi3):
    directory, path, model = phi3
    config, ref = load_model_config(str(path)), model.config
    assert config.architectures == ["Phi3ForCausalLM"] and config.model_type == "phi3"
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "sliding_window",
        "tie_word_embeddings",
        "vocab_size",
    ):
        assert getattr(config, field) == getattr(ref, field), field
    got, want = config.rope_parameters, ref.rope_parameters
    for key in ("rope_type", "rope_theta", "partial_rotary_factor", "short_factor"):
        assert got[key] == pytest.approx(want[key]), key
    assert got["long_factor"] == pytest.approx(want["long_factor"])
    assert got["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))


def test_phi3_gguf_greedy_equals_the_safetensors_checkpoint(phi3):
    directory, path, _ = phi3
    from_gguf = greedy(LLM(model=str(path), tokenizer=str(directory), **LLM_KWARGS))
    assert from_gguf == greedy(LLM(model=str(directory), **LLM_KWARGS))
    assert len({tuple(t) for t in from_gguf}) == len(PROMPTS)


def test_phi4_mini_like_gguf_has_no_window_and_default_rope(tmp_path, hf_gguf_tokenizer):
    """Phi-4-mini's converter writes sliding_window 0 and, without LongRoPE factors, plain RoPE
    over the partial rotary width; no ``output.weight``: a tied LM head."""
    model = build_hf_model(
        tiny_config("phi3", tie_word_embeddings=True, sliding_window=None, rope_scaling=None)
    )
    assert model.config.sliding_window is None and model.config.tie_word_embeddings
    config = load_model_config(str(phi3_gguf(model, tmp_path / "phi4.gguf")))
    assert (config.sliding_window, config.tie_word_embeddings, config.head_dim) == (None, True, 16)
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_parameters["partial_rotary_factor"] == 0.75


# ---------------------------------------------------------------- gemma2, gemma3

# Hugging Face name (after ``model.layers.{i}.``) -> llama.cpp's, as Gemma2Model/Gemma3Model
# write them
_GEMMA_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}


def gemma_gguf(model, arch: str, path: Path) -> Path:
    """Convert a transformers Gemma 2/3 as llama.cpp's ``Gemma2Model``/``Gemma3Model`` do: every
    ``*norm.weight`` stored as ``1 + w``, no ``lm_head`` (tied), the global layers' RoPE theta
    only, the soft caps the config sets, and neither the local/global pattern nor
    ``query_pre_attn_scalar`` (llama.cpp fixes those per architecture). No vocabulary: pass the
    checkpoint's tokenizer with ``tokenizer=``."""
    config = model.config
    rope = config.rope_parameters
    metadata = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim,
        "rope.freq_base": float(rope.get("full_attention", rope)["rope_theta"]),
        "attention.sliding_window": config.sliding_window,
        "vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key):
            metadata[key] = float(getattr(config, key))
    tensors: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        base, _, suffix = name.rpartition(".")
        if base == "lm_head":
            continue
        if base.startswith("model.layers."):
            layer, _, part = base.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{_GEMMA_LAYER[part]}.{suffix}"
        else:
            gguf_name = f"{_GEMMA_TOP[base]}.{suffix}"
        tensors[gguf_name] = tensor + 1 if name.endswith("norm.weight") else tensor
    return write_gguf(path, arch, metadata, tensors)


def gemma_model(kind: str, layers: int, seed: int):
    """A tiny ``kind`` model with llama.cpp's fixed choices: every ``6``th (Gemma 3) or 2nd
    (Gemma 2) layer global, ``query_pre_attn_scalar`` the head size."""
    period = 6 if kind == "gemma3" else 2
    config = tiny_config(kind)
    config.num_hidden_layers = layers
    config.layer_types = [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)
    ]
    config.query_pre_attn_scalar = config.head_dim
    return build_hf_model(config, seed)


@pytest.fixture(scope="module", params=[("gemma3", 6), ("gemma2", 4)], ids=["gemma3", "gemma2"])
def gemma(request, tmp_path_factory, hf_gguf_tokenizer):
    """(safetensors dir, GGUF path, transformers model); Gemma 3: five local layers, then a
    global one."""
    kind, layers = request.param
    root = tmp_path_factory.mktemp(f"{kind}_gguf")
    model = gemma_model(kind, layers, seed=3)
    directory = save_checkpoint(model, root / "hf", hf_gguf_tokenizer)
    return directory, gemma_gguf(model, kind, root / f"tiny-{kind}.gguf"), model


def test_gemma_gguf_config_matches_the_checkpoint(gemma):
    directory, path, model = gemma
    config, ref = load_model_config(str(path)), model.config
    assert config.architectures == ref.architectures and config.model_type == ref.model_type
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_parameters",
        "tie_word_embeddings",
        "vocab_size",
    ):
        assert getattr(config, field) == getattr(ref, field), field


def test_gemma_gguf_loads_the_checkpoints_weights_and_greedy_tokens(gemma):
    """The norms come back as ``w`` from the file's ``1 + w``: pyxllm's parameters (``1 + w``
    in both) equal those loaded from safetensors, and so do the greedy tokens."""
    directory, path, _ = gemma
    from_gguf = LLM(model=str(path), tokenizer=str(directory), **LLM_KWARGS)
    from_hf = LLM(model=str(directory), **LLM_KWARGS)
    got = from_gguf.llm_engine.executor.driver.model.state_dict()
    want = from_hf.llm_engine.executor.driver.model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    tokens = greedy(from_gguf)
    assert tokens == greedy(from_hf)
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)
