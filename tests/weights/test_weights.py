"""pyxllm.weights: model sources, configs, tokenizers, generation defaults and weights.

The default GGUF is checked against transformers' own GGUF loading (conftest fixtures); HF
directories and odd GGUF files are made in tmp_path with transformers and gguf.GGUFWriter.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from pyxllm.weights import (
    GenerationDefaults,
    ModelLoadError,
    ModelSource,
    iter_weights,
    load_generation_defaults,
    load_hf_tokenizer,
    load_model_config,
    resolve_model_source,
)
from pyxllm.weights.gguf_loader import unpermute_qk
from pyxllm.weights.gguf_reader import open_gguf

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好。",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tprint(f(3))",
    "  leading spaces, émojis 🙂 and numbers 12345.678",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model_source(None)


@pytest.fixture(scope="module")
def default_config(default_source):
    return load_model_config(default_source)


# ---------------------------------------------------------------- the embedded default model


def test_default_source_is_the_embedded_gguf(default_source, default_gguf_path):
    assert default_source == ModelSource("gguf", default_gguf_path, "SmolLM2-135M-Instruct")
    assert (
        default_gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and default_gguf_path.is_file()
    )
    # the same file passed explicitly is served under its stem
    assert resolve_model_source(str(default_gguf_path)).name == "SmolLM2-135M-Instruct.Q4_1"


def test_default_gguf_tensor_types(default_gguf_path):
    types = [t.ggml_type.name for t in open_gguf(default_gguf_path).tensors]
    assert {name: types.count(name) for name in set(types)} == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_gguf_config_matches_transformers(default_config, hf_gguf_model):
    ref = hf_gguf_model.config
    for attr in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "head_dim",
        "model_type",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(default_config, attr) == getattr(ref, attr), attr
    assert (
        default_config.rope_parameters["rope_theta"]
        == ref.rope_parameters["rope_theta"]
        == 100000.0
    )
    assert default_config.architectures == ["LlamaForCausalLM"] == [type(hf_gguf_model).__name__]
    assert (default_config.num_hidden_layers, default_config.hidden_size) == (30, 576)
    assert default_config.tie_word_embeddings is True


def test_gguf_weights_equal_transformers(default_source, default_config, hf_gguf_model):
    expected = hf_gguf_model.state_dict()
    seen = set()
    for name, tensor in iter_weights(default_source, default_config):
        assert name not in seen, f"{name} yielded twice"
        seen.add(name)
        assert name in expected, name
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
    assert "lm_head.weight" not in seen  # tied: the file has no output.weight
    assert seen | {"lm_head.weight"} == set(expected)
    assert len(seen) == 272


def test_gguf_tokenizer_matches_transformers(default_source, hf_gguf_tokenizer):
    tok = load_hf_tokenizer(default_source)
    assert tok.is_fast
    for text in TEXTS:
        assert tok(text).input_ids == hf_gguf_tokenizer(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    assert tok.chat_template and tok.chat_template == hf_gguf_tokenizer.chat_template
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == hf_gguf_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tok(rendered).input_ids == hf_gguf_tokenizer(rendered).input_ids
    assert (tok.eos_token_id, tok.bos_token_id) == (
        hf_gguf_tokenizer.eos_token_id,
        hf_gguf_tokenizer.bos_token_id,
    )


def test_default_generation_defaults(default_source, default_config):
    """The embedded model's GGUF has no generation config: its model card's temperature 0.2
    and top_p 0.9 stand in (``auto``); ``vllm`` takes none."""
    defaults = load_generation_defaults(default_source, default_config)
    assert isinstance(defaults, GenerationDefaults)
    assert defaults.eos_token_ids == (2,)
    assert defaults.sampling == {"temperature": 0.2, "top_p": 0.9}
    assert load_generation_defaults(default_source, default_config, "vllm").sampling == {}


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's converter: per head, rows (2, d/2) -> (d/2, 2) interleaved; written from its
    # description
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = np.empty_like(w)
    for h in range(heads):
        for i in range(head_dim // 2):
            for c in range(2):
                permuted[h * head_dim + 2 * i + c] = w[h * head_dim + c * head_dim // 2 + i]
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, heads), w)
    assert np.array_equal(unpermute_qk(permuted[:, 0], heads), w[:, 0])  # a bias


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("shard", ["50KB", None])
def test_hf_directory(tmp_path, shard, hf_gguf_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
        eos_token_id=3,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [3, 7, 9],
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "do_sample": True,
                "max_new_tokens": 64,
            }
        )
    )
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)

    source = resolve_model_source(str(tmp_path))
    assert (source.kind, source.name) == ("hf", tmp_path.name)
    config = load_model_config(source)
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (
        64,
        2,
        False,
    )
    assert config.architectures == ["LlamaForCausalLM"]

    expected = model.state_dict()
    weights = dict(iter_weights(source, config))
    assert set(weights) == set(expected) and "lm_head.weight" in weights
    for name, tensor in weights.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name

    defaults = load_generation_defaults(source, config)
    assert defaults.eos_token_ids == (3, 7, 9)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    tok = load_hf_tokenizer(source)
    assert tok(TEXTS[1]).input_ids == hf_gguf_tokenizer(TEXTS[1]).input_ids
    assert tok.chat_template == hf_gguf_tokenizer.chat_template


# ---------------------------------------------------------------- small GGUF files made here


def _write_gguf(path, arch: str, tensors: dict[str, np.ndarray], **extra) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.context_length", 128)
    writer.add_uint32(f"{arch}.embedding_length", 16)
    writer.add_uint32(f"{arch}.feed_forward_length", 32)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_uint32(f"{arch}.vocab_size", 32)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 5)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 6)
    for key, value in extra.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rand(*shape) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def test_qwen3_gguf_has_no_permutation_and_maps_norms(tmp_path):
    head_dim = 12  # attention.key_length, not embedding_length / head_count (= 8)
    tensors = {
        "token_embd.weight": _rand(32, 16),
        "output_norm.weight": _rand(16),
        "output.weight": _rand(32, 16),
        "blk.0.attn_q.weight": _rand(2 * head_dim, 16),
        "blk.0.attn_k.weight": _rand(head_dim, 16),
        "blk.0.attn_q_norm.weight": _rand(head_dim),
        "blk.0.attn_k_norm.weight": _rand(head_dim),
    }
    path = tmp_path / "tiny-qwen3.gguf"
    _write_gguf(path, "qwen3", tensors, **{"attention.key_length": head_dim})
    source = resolve_model_source(str(path))
    config = load_model_config(source)
    assert config.architectures == ["Qwen3ForCausalLM"] and config.model_type == "qwen3"
    assert (config.head_dim, config.tie_word_embeddings, config.rope_parameters["rope_theta"]) == (
        12,
        False,
        1e6,
    )
    weights = dict(iter_weights(source, config))
    assert torch.equal(
        weights["model.layers.0.self_attn.q_proj.weight"],
        torch.from_numpy(tensors["blk.0.attn_q.weight"]),
    )
    assert torch.equal(
        weights["model.layers.0.self_attn.k_norm.weight"],
        torch.from_numpy(tensors["blk.0.attn_k_norm.weight"]),
    )
    assert torch.equal(weights["lm_head.weight"], torch.from_numpy(tensors["output.weight"]))
    assert load_generation_defaults(source, config).eos_token_ids == (5, 6)


def test_qwen3moe_gguf_experts_are_split(tmp_path):
    gate = _rand(4, 8, 16)  # [experts, moe_intermediate, hidden]
    path = tmp_path / "tiny-moe.gguf"
    _write_gguf(
        path,
        "qwen3moe",
        {"blk.0.ffn_gate_exps.weight": gate, "blk.0.ffn_gate_inp.weight": _rand(4, 16)},
        expert_count=4,
        expert_used_count=2,
        expert_feed_forward_length=8,
    )
    config = load_model_config(str(path))
    assert (
        config.model_type,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
    ) == ("qwen3_moe", 4, 2, 8)
    assert config.norm_topk_prob is True
    weights = dict(iter_weights(str(path), config))
    assert set(weights) == {"model.layers.0.mlp.gate.weight"} | {
        f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)
    }
    assert torch.equal(
        weights["model.layers.0.mlp.experts.2.gate_proj.weight"], torch.from_numpy(gate[2])
    )


# ---------------------------------------------------------------- errors


def test_missing_path():
    with pytest.raises(ModelLoadError, match=r"/no/such/model.*does not exist.*\.gguf"):
        resolve_model_source("/no/such/model")


def test_directory_without_config(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"has no config\.json.*x\.gguf"):
        resolve_model_source(str(tmp_path))


def test_unknown_file_type(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"weights\.txt.*not a supported model file.*\.gguf"):
        resolve_model_source(str(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"fake\.gguf is not a GGUF file"):
        load_model_config(str(path))


@pytest.mark.parametrize("size", [1 << 20, 40 << 20], ids=["in-metadata", "in-tensor-data"])
def test_truncated_gguf(tmp_path, default_gguf_path, size):
    path = tmp_path / "cut.gguf"
    with open(default_gguf_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(size))
    source = resolve_model_source(str(path))
    message = r"cut\.gguf is truncated or corrupt.*re-download it"
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(source)
    with pytest.raises(ModelLoadError, match=message):
        iter_weights(source, None)
    with pytest.raises(ModelLoadError, match=message):
        load_hf_tokenizer(source)


def test_index_naming_a_missing_shard(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    source = resolve_model_source(str(tmp_path))
    with pytest.raises(
        ModelLoadError, match=rf"index\.json names weight file\(s\) {shards[-1].name}.*missing"
    ):
        iter_weights(source, load_model_config(source))


def test_directory_without_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        iter_weights(str(tmp_path), None)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "tiny-gpt2.gguf"
    _write_gguf(path, "gpt2", {"token_embd.weight": _rand(32, 16)})
    with pytest.raises(
        ModelLoadError,
        match=r"tiny-gpt2\.gguf has GGUF architecture 'gpt2'.*llama, qwen2, qwen3, qwen3moe",
    ):
        load_model_config(str(path))
    with pytest.raises(ModelLoadError, match=r"'gpt2'"):
        iter_weights(str(path), None)


def test_gguf_cache_sees_a_rewritten_file(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path, "qwen2", {"token_embd.weight": _rand(32, 16)})
    assert load_model_config(str(path)).model_type == "qwen2"
    _write_gguf(
        path, "gpt2", {"token_embd.weight": _rand(32, 16)}, extra_key=1
    )  # a different size, so the cache key changes
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model_config(str(path))
