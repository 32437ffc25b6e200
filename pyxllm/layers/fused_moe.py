"""Mixture-of-experts layer with every expert's weights stacked in two parameters (vLLM's
``FusedMoE``).

Under tensor parallelism each rank holds, for every expert, a slice of ``moe_intermediate_size``:
the gate/up rows are split like a column-parallel layer and the down projection's columns like a
row-parallel one, so a rank's output is a partial sum, reduced with one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)
from pyxllm.layers.weight_utils import materialize


def make_expert_params_mapping(
    gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> dict[str, tuple[str, str]]:
    """How per-expert checkpoint tensors pack into ``FusedMoE``'s stacked parameters.

    Maps the module name after ``experts.{e}.`` in a checkpoint name to ``(parameter prefix,
    shard id)``: ``experts.{e}.gate_proj.weight`` -> ``experts.w13_weight`` shard ``"w1"``,
    ``up_proj`` -> ``w13_weight`` shard ``"w3"``, ``down_proj`` -> ``w2_weight`` shard ``"w2"``.
    A model exposes it as ``expert_params_mapping`` for ``load_weights``; pass other names for
    checkpoints that spell the experts differently (e.g. Mixtral's ``w1``, ``w3``, ``w2``).
    """
    return {gate: ("w13_", "w1"), up: ("w13_", "w3"), down: ("w2_", "w2")}


class FusedMoE(nn.Module):
    """Top-k routed SwiGLU experts: ``forward(hidden [T, hidden], router_logits [T, num_experts]) ->
    [T, hidden]``.

    Parameters (this rank, ``inter = intermediate_size // tp_size``):
        ``w13_weight [num_experts, 2 * inter, hidden]``: each expert's gate rows, then its up rows.
        ``w2_weight [num_experts, hidden, inter]``: each expert's down projection.

    Raises:
        ValueError: ``intermediate_size`` not divisible by the TP size.
    """

    # the routing reads per-expert token counts on the host: a captured step would replay the
    # capture-time routing, so ``--graph-backend graph`` refuses models with this layer
    capturable = False

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size ({self.tp_size})"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size_per_rank = inter = intermediate_size // self.tp_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        """Copy this rank's slice of one expert's full checkpoint tensor into the stacked parameter.

        Args:
            loaded: ``gate_proj`` / ``up_proj`` ``[intermediate_size, hidden]`` (shard ``"w1"`` /
                ``"w3"``)
                or ``down_proj`` ``[hidden, intermediate_size]`` (shard ``"w2"``); a tensor or an
                unread ``LazyWeight`` (only this rank's slice is read).
            expert_id: the expert's index in ``[0, num_experts)``.
        Raises:
            ValueError: an expert id out of range, an unknown shard id, or a shape that does not
                fit.
        """
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(
                f"{type(self).__name__}: expert {expert_id} is out of range (the model has "
                f"{self.num_experts})"
            )
        inter = self.intermediate_size_per_rank
        if shard_id in ("w1", "w3"):
            dest = param.data[expert_id].narrow(0, 0 if shard_id == "w1" else inter, inter)
            dim = 0
        elif shard_id == "w2":
            dest, dim = param.data[expert_id], 1
        else:
            raise ValueError(
                f"{type(self).__name__}: unknown expert shard id {shard_id!r} (expected w1, w3 or "
                "w2)"
            )
        full = inter * self.tp_size
        if (
            loaded.dim() != 2
            or loaded.shape[1 - dim] != dest.shape[1 - dim]
            or loaded.shape[dim] != full
        ):
            raise ValueError(
                f"{type(self).__name__}[{shard_id}]: checkpoint shape {tuple(loaded.shape)} does "
                "not fit expert "
                f"slice {tuple(dest.shape)} x tp {self.tp_size}"
            )
        dest.copy_(materialize(loaded.narrow(dim, self.tp_rank * inter, inter)))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = kernels.ops.fused_topk(router_logits, self.top_k, self.renormalize)
        out = kernels.ops.fused_moe(
            hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids
        )
        return tensor_model_parallel_all_reduce(out)
