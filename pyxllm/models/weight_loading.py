"""Loading checkpoint tensors into a model through its parameters' ``weight_loader``."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# Buffers some checkpoints still carry; recomputed by the model, safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into an unsharded parameter (dtype converted).

    Raises:
        ValueError: the shapes differ.
    """
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every ``(hf_name, tensor)`` into ``model``, fusing packed projections.

    A checkpoint name whose module appears in ``model.packed_modules_mapping`` (e.g. ``q_proj``)
    goes to the fused parameter (``qkv_proj``) with its shard id. A tied LM head is skipped.

    Raises:
        ValueError: a checkpoint tensor with no parameter to go to, a parameter the checkpoint
            did not provide (each named), or a shape mismatch.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        shard_id, target = None, name
        for ckpt_key, (packed, shard) in mapping.items():
            if f".{ckpt_key}." in name:
                target, shard_id = name.replace(f".{ckpt_key}.", f".{packed}."), shard
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        param = params[target]
        with torch.no_grad():
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        loaded.add(target)
    if tied:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
