"""Linear layers that know how they are split across tensor-parallel ranks.

Names and sharding follow vLLM (Megatron-LM's column/row split, Shoeybi et al. 2019): a
column-parallel layer splits its output features across ranks, a row-parallel layer splits its
input features and sums the partial results with one all-reduce. Each weight parameter carries a
``weight_loader(param, loaded_weight, shard_id=None)`` that copies this rank's slice of a full
checkpoint tensor into it, so model loading is one loop over checkpoint tensors. ``loaded_weight``
is a tensor or an unread :class:`~pyxllm.weights.lazy.LazyWeight`; loaders narrow it first, so a
rank reads only its own slice from the file.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)
from pyxllm.layers.quantization.weight_only import UNQUANTIZED
from pyxllm.layers.weight_utils import materialize


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def load_rows(param: nn.Parameter, loaded, name: str, offset: int = 0, rows: int | None = None):
    """Fill rows ``offset .. offset + rows`` (default: the rest) of ``param`` from ``loaded`` (a
    tensor or a narrowed ``LazyWeight``, read here).

    Where the parameter collects its checkpoint's stored format (``param.stored_rows``, see
    ``pyxllm.layers.quantization.stored``) and the checkpoint stores this region in one a kernel
    takes, the region is kept in that format and ``param`` is not written.

    Raises:
        ValueError: the shapes differ (naming ``name``).
    """
    rows = param.shape[0] - offset if rows is None else rows
    target = param.data.narrow(0, offset, rows)
    if target.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(loaded.shape)} does not fit parameter slice "
            f"{tuple(target.shape)}"
        )
    stored = getattr(param, "stored_rows", None)
    if stored is not None and stored.add(offset, loaded):
        return
    target.copy_(materialize(loaded))


def _check_fused_rows(loaded, rows: int, name: str) -> None:
    """A fused checkpoint tensor must hold exactly the rows of every piece, before it is cut."""
    if loaded.shape[0] != rows:
        raise ValueError(
            f"{name}: fused checkpoint shape {tuple(loaded.shape)} does not have the {rows} "
            "rows of its pieces"
        )


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with ``W`` of shape ``[output_size, input_size]`` on this rank.

    The matmul is ``quant_method.apply``: ``F.linear`` unless ``--quantization`` replaced the
    weight after loading (see ``pyxllm.layers.quantization``).
    """

    quant_method = UNQUANTIZED
    quantizable = True

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_rows(param, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer held whole on every rank (a MoE router; never quantized: its top-k
    choice of experts is sensitive to small changes)."""

    quantizable = False


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank ``r`` holds rows ``[r*n, (r+1)*n)`` of ``W``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, _divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        load_rows(param, loaded.narrow(0, self.tp_rank * size, size), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (e.g. ``gate_proj`` and ``up_proj``).

    ``shard_id`` is the index of the checkpoint tensor in ``output_sizes``; ``None``: the
    checkpoint stores them fused already (Phi-3's ``gate_up_proj``, all ``output_sizes`` rows
    in order), and each is cut out and split by rank as if it came alone.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            _check_fused_rows(loaded, sum(self.output_sizes), type(self).__name__)
            offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            for i, (offset, size) in enumerate(zip(offsets, self.output_sizes, strict=True)):
                self.weight_loader(param, loaded.narrow(0, offset, size), i)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        load_rows(param, shard, f"{type(self).__name__}[{shard_id}]", offset, size)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused in one matmul, split by attention head.

    When the TP size exceeds the number of KV heads, each KV head is replicated on
    ``tp_size // total_num_kv_heads`` ranks (as vLLM does). ``shard_id`` is ``"q"``, ``"k"`` or
    ``"v"``; ``None``: the checkpoint stores them fused already (Phi-3's ``qkv_proj``: all query
    heads, then all key heads, then all value heads), and each is cut out and split by rank as
    if it came alone.

    Raises:
        ValueError: the TP size does not divide the query heads, or neither divides nor is a
            multiple of the KV heads (naming both head counts and the TP size).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        kv_fits = total_num_kv_heads % tp_size == 0 or tp_size % total_num_kv_heads == 0
        if total_num_heads % tp_size or not kv_fits:
            raise ValueError(
                f"--tensor-parallel-size {tp_size}: does not fit {total_num_heads} attention "
                f"heads and {total_num_kv_heads} KV heads: it must divide the attention heads, "
                "and divide or be a multiple of the KV heads"
            )
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp_size
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = (
                _divide(total_num_kv_heads, tp_size, "number of KV heads"),
                1,
            )
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:
            q_rows = self.total_num_heads * self.head_dim
            kv_rows = self.total_num_kv_heads * self.head_dim
            _check_fused_rows(loaded, q_rows + 2 * kv_rows, type(self).__name__)
            for shard, offset, size in (
                ("q", 0, q_rows),
                ("k", q_rows, kv_rows),
                ("v", q_rows + kv_rows, kv_rows),
            ):
                self.weight_loader(param, loaded.narrow(0, offset, size), shard)
            return
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        shard = loaded.narrow(0, rank * size, size)
        load_rows(param, shard, f"{type(self).__name__}[{shard_id}]", offset, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce.

    The bias, if any, is added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(_divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: whole on every rank
            load_rows(param, loaded, type(self).__name__)
            return
        size = param.shape[1]
        load_rows(param, loaded.narrow(1, self.tp_rank * size, size), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x))
        return y if self.bias is None else y + self.bias
