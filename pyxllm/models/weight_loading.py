"""Loading checkpoint tensors into a model through its parameters' ``weight_loader``.

A model declares how checkpoint names reach its fused parameters:

- ``packed_modules_mapping``: ``{ckpt module: (fused module, shard id)}``, e.g. ``"q_proj":
  ("qkv_proj", "q")``; the loader is called as ``weight_loader(param, tensor, shard_id)``.
- ``expert_params_mapping`` (MoE models, see ``layers.fused_moe.make_expert_params_mapping``):
  ``{ckpt module after experts.{e}.: (parameter prefix, shard id)}``, e.g. ``"gate_proj":
  ("w13_", "w1")`` sends ``...experts.{e}.gate_proj.weight`` to ``...experts.w13_weight``; the
  loader
  is called as ``weight_loader(param, tensor, shard_id, expert_id)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pyxllm.layers.weight_utils import materialize

# Buffers some checkpoints still carry; recomputed by the model, safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.([^.]+)\.")

# (parameter name, shard id or None, expert id or None): one piece a checkpoint tensor fills
_Piece = tuple[str, object, int | None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into an unsharded parameter (dtype converted).

    Raises:
        ValueError: the shapes differ.
    """
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape "
            f"{tuple(param.shape)}"
        )
    param.data.copy_(materialize(loaded))


def _route(name: str, packed: dict, experts: dict) -> _Piece:
    """Where checkpoint tensor ``name`` goes: ``(parameter name, shard id, expert id)``."""
    match = _EXPERT_NAME.search(name) if experts else None
    if match and match.group(2) in experts:
        prefix, shard = experts[match.group(2)]
        return (
            f"{name[: match.start()]}.experts.{prefix}{name[match.end() :]}",
            shard,
            int(match.group(1)),
        )
    for ckpt_key, (fused, shard) in packed.items():
        if f".{ckpt_key}." in name:
            return name.replace(f".{ckpt_key}.", f".{fused}."), shard, None
    return name, None, None


def _expected(params: dict[str, nn.Parameter], packed: dict, experts: dict) -> dict[_Piece, str]:
    """Every piece the checkpoint must provide, keyed to the checkpoint name that provides it."""
    expected: dict[_Piece, str] = {}
    for pname, param in params.items():
        pieces = {}
        for ckpt_key, (prefix, shard) in experts.items():
            if f".experts.{prefix}" in pname:
                for e in range(param.shape[0]):
                    pieces[(pname, shard, e)] = pname.replace(
                        f".experts.{prefix}", f".experts.{e}.{ckpt_key}."
                    )
        is_expert = bool(pieces)
        for ckpt_key, (fused, shard) in packed.items():
            if not is_expert and f".{fused}." in pname:
                pieces[(pname, shard, None)] = pname.replace(f".{fused}.", f".{ckpt_key}.")
        expected.update(pieces or {(pname, None, None): pname})
    return expected


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every ``(hf_name, tensor)`` into ``model``, fusing packed projections and stacking
    experts.

    A tensor may be an unread ``LazyWeight`` (``iter_weight_slices``): each parameter's loader
    then reads only this TP rank's slice of it.

    Names are routed through the model's ``expert_params_mapping`` first, then its
    ``packed_modules_mapping`` (see the module docstring), after the model's
    ``rename_checkpoint_tensor(name) -> name`` where it has one (the transformers backend's
    renamings; ``None`` skips a tensor the model does not use); a name that is a parameter's
    own loads as is. A tied LM head (the model's ``lm_head_name``, default ``lm_head.weight``;
    tied per its ``tied_lm_head``, else its config's ``tie_word_embeddings``) is skipped.

    Raises:
        ValueError: a checkpoint tensor with no parameter to go to, a piece of a parameter the
            checkpoint did not provide (each named by its checkpoint name, e.g. one expert's
            ``up_proj``), or a tensor that does not fit (naming it).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_params_mapping", {})
    tied = getattr(model, "tied_lm_head", None)
    if tied is None:
        tied = getattr(model.config, "tie_word_embeddings", False)
    head = getattr(model, "lm_head_name", "lm_head.weight")
    rename = getattr(model, "rename_checkpoint_tensor", None)
    loaded: set[_Piece] = set()
    for name, tensor in weights:
        key = name if rename is None else rename(name)
        if key is None or key.endswith(_IGNORED_SUFFIXES) or (tied and key == head):
            continue
        # a tensor named as a parameter loads as is (a library module's q_proj inside a model
        # whose own q/k/v are fused: LLaVA's transformers vision tower)
        piece = (key, None, None) if key in params else _route(key, packed, experts)
        target, shard_id, expert_id = piece
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}"
            )
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                if expert_id is None:
                    loader(param, tensor, shard_id)
                else:
                    loader(param, tensor, shard_id, expert_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
        loaded.add(piece)
    if tied:
        loaded.add((head, None, None))
    missing = sorted(
        ckpt for piece, ckpt in _expected(params, packed, experts).items() if piece not in loaded
    )
    if missing:
        raise ValueError(
            "checkpoint is missing weights: "
            f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}"
        )
