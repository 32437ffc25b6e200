"""Reading Hugging Face config fields that changed spelling between transformers versions, and
refusing the ones pyxllm does not implement."""

from __future__ import annotations

from typing import Any


def head_dim_of(config) -> int:
    """Per-head dimension: ``config.head_dim`` when set, else ``hidden_size //
    num_attention_heads``."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` fields; scaling is ``None`` for plain RoPE."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(theta), None if kind == "default" else dict(scaling)


def check_full_attention(config) -> None:
    """Reject configs whose layers use sliding-window attention (not implemented yet).

    Raises:
        ValueError: some ``config.layer_types`` entry is ``"sliding_attention"``.
    """
    sliding = [
        i
        for i, kind in enumerate(getattr(config, "layer_types", None) or [])
        if kind == "sliding_attention"
    ]
    if sliding:
        raise ValueError(
            f"sliding-window attention (layers {sliding[:4]}{'…' if len(sliding) > 4 else ''}) is "
            "not supported; "
            "use a checkpoint with use_sliding_window false"
        )
