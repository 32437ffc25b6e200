"""GGUF -> Hugging Face: a transformers config from the metadata, and HF-named float32 weights.

Key names follow llama.cpp's ``convert_hf_to_gguf.py`` and ``gguf-py/gguf/constants.py``
(``{arch}.block_count``, ``blk.{i}.attn_q.weight``, ...). The Q/K row permutation that the
converter applies to llama's ``attn_q``/``attn_k`` (``LlamaModel.permute``) is undone here; the
qwen2/qwen3/qwen3moe/phi3/gemma converters do not permute. phi3 files (``Phi3MiniModel``) keep the
checkpoint's fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows), state the rotary width
as ``rope.dimension_count`` (a partial rotary factor) and store LongRoPE's factors as the
tensors ``rope_factors_long``/``rope_factors_short``, read here into the config. gemma2/gemma3
files (``Gemma2Model``/``Gemma3Model``) store every norm weight ``w`` as ``1 + w`` (Gemma's
RMSNorm scale), given back here as ``w``, and leave out what llama.cpp fixes by architecture:
see :func:`_gemma_config`.

:func:`iter_gguf_weight_slices` yields unread :class:`GGUFWeight` s: a tensor-parallel rank
dequantizes only its own rows (see :meth:`GGUFFile.read_region` for columns).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyxllm.weights.errors import ModelLoadError
from pyxllm.weights.gguf_blocks import (
    INT4_TYPES,
    INT8_TYPES,
    int4_groups,
    int8_groups,
    super_block_scales,
    super_block_shift,
)
from pyxllm.weights.gguf_reader import GGUFFile, GGUFTensorInfo, open_gguf
from pyxllm.weights.lazy import LazyWeight, StoredGroups

# GGUF architecture -> (transformers model_type, architectures)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

# {arch}.<key> -> config attribute, shared by every supported architecture
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: fused already
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# per-architecture exceptions to _PER_LAYER
_GEMMA_PER_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_PER_LAYER = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # phi3's ffn_up holds gate and up
    "gemma2": _GEMMA_PER_LAYER,
    "gemma3": _GEMMA_PER_LAYER,
}
# architectures whose ``*norm.weight`` tensors hold ``1 + w``, and what llama.cpp fixes for each:
# (local/global pattern: every n-th layer global, layer count of the 27B, whose attention scale
# is ``(hidden / heads) ** -0.5`` rather than ``head_dim ** -0.5``)
_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}
# stacked experts [num_experts, out, in] -> one tensor per expert
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# tensors with no Hugging Face counterpart (llama3 rope factors are recomputed from the config;
# phi3's LongRoPE factors are read into it, see _phi3_config)
_LONGROPE_FACTORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
_IGNORED = {"rope_freqs.weight", *_LONGROPE_FACTORS.values()}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_architecture(gguf: GGUFFile) -> str:
    """The file's ``general.architecture``, checked against :data:`GGUF_ARCHITECTURES`.

    Raises:
        ModelLoadError: the architecture is not supported; the message lists those that are.
    """
    arch = gguf.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path} has GGUF architecture {arch!r}, which pyxllm does not support; "
            f"supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}."
        )
    return arch


def gguf_config_dict(path: str | Path) -> dict[str, Any]:
    """Keyword arguments for ``AutoConfig.for_model`` describing the GGUF model at ``path``.

    Includes ``model_type``, ``architectures``, shapes, ``rope_theta`` (or ``rope_parameters``
    when the file states a rope scaling), ``tie_word_embeddings`` (true when the file has no
    ``output.weight``) and the bos/eos/pad token ids from ``tokenizer.ggml.*``.

    Raises:
        ModelLoadError: unreadable file or unsupported architecture.
    """
    gguf = open_gguf(path)
    arch = gguf_architecture(gguf)
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    meta = gguf.metadata
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "_name_or_path": str(gguf.path),
    }
    for key, attr in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[attr] = meta[f"{arch}.{key}"]
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in config
    ]
    if missing:
        raise ModelLoadError(
            f"{gguf.path} lacks the metadata for {', '.join(missing)}; it is corrupt or "
            "was written by an incompatible converter. Re-download or re-convert it."
        )
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if arch == "phi3":
        _phi3_config(gguf, config)
    if "head_dim" not in config:  # llama files state the rotary width, equal to the head size there
        config["head_dim"] = meta.get(
            f"{arch}.rope.dimension_count", config["hidden_size"] // config["num_attention_heads"]
        )
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if arch == "qwen3moe":
        config["norm_topk_prob"] = True  # llama.cpp renormalizes the top-k routing weights
    if arch in _GEMMA:
        _gemma_config(gguf, arch, config)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope = {
            "rope_type": scaling,
            "rope_theta": theta,
            "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        if f"{arch}.rope.scaling.original_context_length" in meta:
            rope["original_max_position_embeddings"] = meta[
                f"{arch}.rope.scaling.original_context_length"
            ]
        config["rope_parameters"] = rope
    else:
        config["rope_theta"] = theta
    if arch == "gemma3":  # one RoPE per layer type; llama.cpp's local layers: theta 10,000
        config["rope_parameters"] = {
            "full_attention": config.pop("rope_parameters", None)
            or {"rope_type": "default", "rope_theta": config.pop("rope_theta")},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensor_by_name
    for attr, key in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("pad_token_id", "padding"),
    ):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[attr] = meta[f"tokenizer.ggml.{key}_token_id"]
    return config


def _phi3_config(gguf: GGUFFile, config: dict[str, Any]) -> None:
    """Add what a phi3 file states its own way to ``config``: the head size (``hidden /
    heads``; ``rope.dimension_count`` is the rotary width, giving ``partial_rotary_factor``),
    ``sliding_window`` (0: none, as Phi-4-mini), ``original_max_position_embeddings`` and, where
    the file has LongRoPE's factor tensors, ``rope_parameters`` of type ``longrope`` with them
    and the file's attention factor."""
    meta = gguf.metadata
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = meta.get("phi3.rope.dimension_count", head_dim)
    config["head_dim"] = head_dim
    config["sliding_window"] = meta.get("phi3.attention.sliding_window") or None
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get("phi3.rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary / head_dim,
    }
    if all(name in gguf.tensor_by_name for name in _LONGROPE_FACTORS.values()):
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = original or config["max_position_embeddings"]
        for key, name in _LONGROPE_FACTORS.items():
            rope[key] = gguf.read(gguf.tensor_by_name[name]).reshape(-1).tolist()
        if "phi3.rope.scaling.attn_factor" in meta:
            rope["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    config["rope_parameters"] = rope


def _gemma_config(gguf: GGUFFile, arch: str, config: dict[str, Any]) -> None:
    """Add a gemma2/gemma3 file's window and soft caps to ``config``, and what llama.cpp's
    ``llama-model.cpp`` fixes by architecture instead of reading from the file: the local/global
    ``layer_types`` (every 2nd layer global in Gemma 2, every 6th in Gemma 3, unless the file
    states ``attention.sliding_window_pattern``, a period or one flag per layer, true for local)
    and ``query_pre_attn_scalar`` (``hidden / heads`` for the 27B models, else the head size)."""
    meta = gguf.metadata
    period, layers_27b = _GEMMA[arch]
    layers = config["num_hidden_layers"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", period)
    if not isinstance(pattern, list):  # a period n: every n-th layer global (0: none is)
        pattern = [pattern == 0 or (i + 1) % pattern != 0 for i in range(layers)]
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    config["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    heads = config["num_attention_heads"]
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // heads if layers == layers_27b else config["head_dim"]
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in meta:
            config[key] = float(meta[f"{arch}.{key}"])


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; ``None`` for a tensor HF has no counterpart of.
    Stacked experts map to a template with ``{expert}`` in place of the expert index. ``arch``
    (the file's ``general.architecture``) picks its exceptions, e.g. phi3's fused ``ffn_up``.

    Raises:
        ModelLoadError: the name is not one of the known GGUF tensor names.
    """
    if gguf_name in _IGNORED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{suffix}"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        per_layer = {**_PER_LAYER, **_ARCH_PER_LAYER.get(arch, {})}
        if part in per_layer:
            return f"model.layers.{layer}.{per_layer[part]}.{suffix}"
        if part in _EXPERTS:
            return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERTS[part]}.{suffix}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no known Hugging Face name; this file holds a "
        "model variant pyxllm does not support."
    )


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of a llama ``attn_q``/``attn_k`` weight or bias.

    The converter reorders each head's rows from HF's half-split rotary layout ``(2, d/2)`` to
    llama.cpp's interleaved ``(d/2, 2)``; this puts them back. ``num_heads`` is the query head
    count for ``attn_q`` and the KV head count for ``attn_k``. Shape is kept: ``[out, ...]``.
    """
    shape = weight.shape
    half = shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class GGUFWeight(LazyWeight):
    """One GGUF tensor, or one expert ``e`` of a stacked ``[E, out, in]`` one, dequantized to
    float32 on ``load()``: only the rows in range, and the columns as ``read_region`` allows.

    ``qk_heads``: for llama's ``attn_q``/``attn_k``, the head count the converter permuted with;
    rows are then read in whole heads and un-permuted (see :func:`unpermute_qk`). ``shift`` is
    added to every value read (gemma's norms: -1).
    """

    def __init__(
        self,
        name: str,
        gguf: GGUFFile,
        info: GGUFTensorInfo,
        expert: int | None = None,
        qk_heads: int | None = None,
        shift: float = 0.0,
    ) -> None:
        self.gguf, self.info, self.qk_heads, self.shift = gguf, info, qk_heads, shift
        shape = info.shape[1:] if expert is not None else info.shape
        self.row_base = 0 if expert is None else expert * shape[0]
        super().__init__(name, shape)

    def _read(self, ranges):
        read = self._read_unshifted(ranges)
        return read + self.shift if self.shift else read

    def _read_unshifted(self, ranges):
        if len(ranges) != 2:  # vectors (norms, biases) are small: read whole, then cut
            rows = int(np.prod(self.full_shape[:-1], dtype=np.int64))
            full = self.gguf.read_region(
                self.info, (self.row_base, self.row_base + rows), (0, self.full_shape[-1])
            )
            full = full if self.qk_heads is None else unpermute_qk(full.reshape(-1), self.qk_heads)
            return torch.from_numpy(full.reshape(self.full_shape))[
                tuple(slice(a, b) for a, b in ranges)
            ].clone()
        rows, cols = ranges
        (array,) = self._rows(
            rows, lambda file_rows: [self.gguf.read_region(self.info, file_rows, cols)]
        )
        return torch.from_numpy(np.ascontiguousarray(array))

    def _rows(self, rows: tuple[int, int], read) -> list[np.ndarray]:
        """Rows ``rows`` of this weight from ``read(file rows) -> arrays`` (each with a row per
        file row): llama's permuted ``attn_q``/``attn_k`` are read in whole heads, un-permuted,
        then cut."""
        if self.qk_heads is None:
            return read((self.row_base + rows[0], self.row_base + rows[1]))
        head = self.full_shape[0] // self.qk_heads  # rows per head
        first, last = rows[0] // head, -(-rows[1] // head)
        cut = slice(rows[0] - first * head, rows[1] - first * head)
        return [unpermute_qk(a, last - first)[cut] for a in read((first * head, last * head))]

    def load_stored(self) -> StoredGroups | None:
        """The narrowed region as :class:`StoredGroups` straight from the file's blocks (no
        float copy): Q4_0, Q4_1 and Q4_K as int4 groups of 32, Q8_0, the 5-bit types, IQ4_NL and
        IQ4_XS as int8 groups of 32, Q6_K, Q3_K and Q2_K as int8 groups of 16
        (``pyxllm.weights.gguf_blocks``, exact). ``None`` for other types (float tensors, the
        other IQ types), vectors, shifted tensors
        (gemma's norms) and column ranges that do not start and end on a group of 32."""
        ggml_type = self.info.ggml_type
        if len(self.ranges) != 2 or self.shift or ggml_type not in (*INT4_TYPES, *INT8_TYPES):
            return None
        rows, (start, stop) = self.ranges
        if start % 32 or stop % 32:
            return None
        fmt = "int4" if ggml_type in INT4_TYPES else "int8"
        # the factored scales too, where the columns are whole super-blocks
        factored = start % 256 == 0 and stop % 256 == 0

        def decode(file_rows):
            raw = self.gguf.raw_rows(self.info, file_rows)
            if fmt == "int4":
                (q, scale, zero), group = int4_groups(raw, ggml_type), 32
            else:
                q, scale, zero, group = int8_groups(raw, ggml_type)
            cols = slice(start // group, stop // group)
            arrays = [q[:, start:stop], scale[:, cols], zero[:, cols]]
            supers = super_block_scales(raw, ggml_type) if factored else None
            if supers is not None:
                d, sub = supers
                arrays += [d[:, start // 256 : stop // 256], sub[:, cols]]
            return arrays

        q, scale, zero, *supers = (
            torch.from_numpy(np.ascontiguousarray(a)) for a in self._rows(rows, decode)
        )
        group = q.shape[1] // scale.shape[1]
        shift = super_block_shift(ggml_type) if supers else 0
        return StoredGroups(fmt, q, scale, zero, group, *supers, super_shift=shift)


def iter_gguf_weight_slices(
    path: str | Path, config: Any = None
) -> Iterator[tuple[str, GGUFWeight]]:
    """Iterate ``(hf_name, unread weight)`` over every tensor of the GGUF file, in file order.

    Names as :func:`iter_gguf_weights`; stacked experts come as one weight per expert. Nothing
    is dequantized until a weight's ``load()``.

    Raises:
        ModelLoadError: unreadable file or unsupported architecture (at the call); unknown
            tensor name (when reached).
    """
    gguf = open_gguf(path)  # errors surface here, at the call, not at the first next()
    return _gguf_slices(gguf, _permuted_heads(gguf), gguf_architecture(gguf))


def _permuted_heads(gguf: GGUFFile) -> dict[str, int]:
    """``{"attn_q": heads, "attn_k": kv heads}`` for llama files (whose converter permutes), else
    ``{}``."""
    arch = gguf_architecture(gguf)
    if arch != "llama":  # qwen2/qwen3/qwen3moe converters do not permute
        return {}
    q_heads = gguf.metadata.get(f"{arch}.attention.head_count")
    if not isinstance(q_heads, int):
        raise ModelLoadError(
            f"{gguf.path} lacks {arch}.attention.head_count; it is corrupt or was written "
            "by an incompatible converter. Re-download or re-convert it."
        )
    return {
        "attn_q": q_heads,
        "attn_k": gguf.metadata.get(f"{arch}.attention.head_count_kv", q_heads),
    }


def _gguf_slices(
    gguf: GGUFFile, heads: dict[str, int], arch: str
) -> Iterator[tuple[str, GGUFWeight]]:
    for info in gguf.tensors:
        name = hf_name(info.name, arch)
        if name is None:
            continue
        qk_heads = heads.get(info.name.split(".")[-2])
        if "{expert}" in name:
            for expert in range(info.shape[0]):
                yield (
                    name.format(expert=expert),
                    GGUFWeight(name.format(expert=expert), gguf, info, expert),
                )
        else:
            shift = -1.0 if arch in _GEMMA and info.name.endswith("norm.weight") else 0.0
            yield name, GGUFWeight(name, gguf, info, qk_heads=qk_heads, shift=shift)
    gguf.release_pages()  # every weight was handed out (and, by a loader, copied)


def iter_gguf_weights(path: str | Path, config: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate ``(hf_name, float32 tensor)`` over every tensor of the GGUF file, in file order.

    Each tensor is dequantized when reached (``gguf.quants.dequantize``), so at most one is
    held at a time besides what the caller keeps. Stacked MoE experts ``[E, out, in]`` are
    yielded per expert as ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``.
    llama's Q/K rows are un-permuted with the head counts the file states (those the converter
    permuted with); ``config`` is accepted for symmetry with safetensors loading and unused.

    Raises:
        ModelLoadError: unreadable file or unsupported architecture (at the call); unknown
            tensor name (when reached).
    """
    return ((name, weight.load()) for name, weight in iter_gguf_weight_slices(path, config))
