"""Reading Hugging Face config fields that changed spelling between transformers versions, and
refusing the ones pyxllm does not implement."""

from __future__ import annotations

from typing import Any


def head_dim_of(config) -> int:
    """Per-head dimension: ``config.head_dim`` when set, else ``hidden_size //
    num_attention_heads``."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim or config.hidden_size // config.num_attention_heads


def rope_parameters(config, layer_idx: int | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` fields; scaling is ``None`` for plain RoPE.

    Gemma 3's ``rope_parameters`` is keyed by layer type (``{"full_attention": {...},
    "sliding_attention": {...}}``): layer ``layer_idx`` then reads the entry of
    ``config.layer_types[layer_idx]``.
    """
    params = getattr(config, "rope_parameters", None)
    kinds = getattr(config, "layer_types", None)
    if isinstance(params, dict) and layer_idx is not None and kinds and kinds[layer_idx] in params:
        params = params[kinds[layer_idx]]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(theta), None if kind == "default" else dict(scaling)


# ``config.layer_types`` entries pyxllm runs: transformers' names for full causal attention and
# a causal sliding window of ``config.sliding_window`` tokens
_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(config) -> None:
    """Refuse configs with attention kinds pyxllm does not implement (e.g. Llama 4's
    ``chunked_attention``), before any layer is built.

    Raises:
        ValueError: naming the first unsupported ``config.layer_types`` entry and its layers.
    """
    kinds = list(getattr(config, "layer_types", None) or [])
    for kind in dict.fromkeys(kinds):
        if kind not in _LAYER_TYPES:
            layers = [i for i, k in enumerate(kinds) if k == kind]
            raise ValueError(
                f"attention layer type {kind!r} (layers {layers[:4]}"
                f"{'…' if len(layers) > 4 else ''}) is not supported; supported: "
                f"{', '.join(_LAYER_TYPES)}"
            )


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The sliding window (tokens) of layer ``layer_idx``, or None for full attention.

    As transformers reads it: ``config.layer_types[layer_idx] == "sliding_attention"`` where the
    config lists layer types (Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3), else
    ``config.sliding_window`` for every layer (Mistral, Phi-3, Qwen3-MoE; None there means
    none).
    """
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return config.sliding_window if kinds[layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def attention_scale_of(config) -> float:
    """The attention scores' scale: ``query_pre_attn_scalar ** -0.5`` where the config sets it
    (Gemma 2/3), else ``head_dim ** -0.5``."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return (scalar or head_dim_of(config)) ** -0.5


def logits_soft_cap_of(config) -> float | None:
    """The attention scores' tanh soft cap, ``config.attn_logit_softcapping`` (Gemma 2: 50), or
    None."""
    return getattr(config, "attn_logit_softcapping", None) or None
