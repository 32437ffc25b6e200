"""Serving many LoRA adapters on one base model, batched together (``--enable-lora``).

Every linear layer of the decoder (not the LM head or the embedding) gets a
:class:`LoRALinearMethod` around its own ``quant_method``: the base matmul runs once for the
whole step, whatever adapters its rows use, and then each adapter present in the step adds
``B (A x)`` to its own rows only (a gather, two small matmuls, a scatter-add: vLLM's punica
idea, "segmented" LoRA, written as plain ops). Rows without an adapter get the base output. So
requests on different adapters and on the base model share every step.

The adapters' matmuls run in float32 on the platform's row-invariant ``linear`` (the CPU's), so
a row's delta has the same bits whichever rows share its step. The base weights may be
quantized (``--quantization``, a GGUF file's blocks) or bfloat16; the float32 delta is added to
the base output in its dtype.

Adapters are loaded once (:meth:`LoRAManager.add`, validated then) and kept up to
``--max-cpu-loras``, the least recently used one dropped for a new one (and read again from its
directory when a request needs it later); the scheduler lets at most ``--max-loras`` distinct
adapters into one step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.layers.forward_context import current_forward_context
from pyxllm.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from pyxllm.lora_request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRAStep:
    """One step's adapters and the rows (flattened tokens) each applies to.

    Attributes:
        segments: ``(adapter, rows)`` for each adapter in the step: ``rows`` an ``int64 [n]``
            index tensor, or ``None`` when the adapter covers every row of the step.
        row_adapter: with few rows (a decode step, :data:`STACKED_MAX_ROWS`), ``int64 [T]``:
            each row's position in ``segments`` (-1: the base model); the layers then run
            every adapter of the step in one ``lora_delta`` call. ``None``: one pair of
            matmuls per adapter, over its own rows.
        adapter_rows: the rows that have an adapter (``int64``), ``None`` when all do.
        stacks: filled by the layers: ``{layer path: _stack(...)}``, the step's adapters'
            weights side by side (kept across steps with the same adapters on the same rows,
            see :class:`LoRAManager`).
    """

    segments: list[tuple[LoRAAdapter, torch.Tensor | None]]
    row_adapter: torch.Tensor | None = None
    adapter_rows: torch.Tensor | None = None
    stacks: dict = field(default_factory=dict)


# up to this many rows a step runs all its adapters in one lora_delta call per layer (a kernel
# call against ~7 small ops per adapter); above it, one pair of row-wise matmuls per adapter over
# its rows (register-blocked over rows: the faster for a prefill's hundreds of rows)
STACKED_MAX_ROWS = 64


class LoRALinearMethod:
    """A layer's own ``quant_method`` plus the LoRA deltas of the step's adapters (see the
    module docstring); the layer is found in an adapter's weights by its module ``path``."""

    def __init__(self, base, path: str) -> None:
        self.base, self.path = base, path

    @property
    def name(self):
        """The base method's name (``None`` for float weights)."""
        return self.base.name

    @property
    def batch_invariant(self) -> bool:
        """Whether the base matmul is row-invariant (the float32 deltas are on the CPU)."""
        return getattr(self.base, "batch_invariant", False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``base(x) + B (A x)`` on each adapter's rows of ``x [T, in]`` -> ``[T, out]``.

        The deltas are computed in float32 on the platform's row-invariant ``linear`` where it
        has one (so a row's delta does not depend on the other rows), then added to the base
        output in its dtype: each adapter's rows gathered, added to, and written back whole
        (row copies; a scatter-add into a column slice took ~100 us a call on the CPU).
        """
        y = self.base.apply(layer, x, bias)
        context = current_forward_context()
        step = None if context is None else context.lora
        if step is None:
            return y
        if step.row_adapter is not None:
            return self._add_stacked(y, x, step)
        for adapter, rows in step.segments:
            weights = adapter.layers.get(self.path)
            if weights is None:
                continue
            xs = (x if rows is None else x.index_select(0, rows)).float()
            xa = kernels.ops.linear(xs, weights.a, None, True)
            delta = kernels.ops.linear(xa, weights.b, None, True)
            _add_to_rows(y, rows, delta)
        return y

    def _add_stacked(self, y: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """Every adapter of a small step in one ``lora_delta`` call over their weights stacked,
        each row computing its own adapter's pair only, in the order the per-adapter path
        sums it (so a row gets the same bits either way)."""
        stack = step.stacks.get(self.path)
        if stack is None:
            stack = step.stacks[self.path] = _stack(step, self.path, y.device)
        if not stack:
            return y
        a, b, row_adapter, offsets, lens = stack
        delta = kernels.ops.lora_delta(x.float(), a, b, row_adapter, offsets, lens)
        rows = step.adapter_rows
        return _add_to_rows(y, rows, delta if rows is None else delta.index_select(0, rows))


def _add_to_rows(y: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> torch.Tensor:
    """``y[rows] += delta`` (every row when ``rows`` is None), in place, by whole rows: gathered,
    added to and written back (a scatter-add into a column slice took ~100 us a call)."""
    if rows is None:
        return y.add_(delta)
    return y.index_copy_(0, rows, y.index_select(0, rows).add_(delta))


def _stack(step: LoRAStep, path: str, device: torch.device) -> tuple:
    """The step's adapters' weights for layer ``path`` side by side: ``(a [S, in], b [out, S],
    each row's adapter among them (-1: none), their column offsets, their ranks)``; ``()`` when
    none adapts the layer."""
    pieces = [
        (i, adapter.layers[path])
        for i, (adapter, _) in enumerate(step.segments)
        if path in adapter.layers
    ]
    if not pieces:
        return ()
    position = {i: j for j, (i, _) in enumerate(pieces)}
    row_adapter = step.row_adapter.clone()
    for i in range(len(step.segments)):  # segment index -> index among the layer's pieces
        row_adapter[step.row_adapter == i] = position.get(i, -1)
    lens = torch.tensor([w.a.shape[0] for _, w in pieces], dtype=torch.long)
    offsets = torch.cumsum(lens, 0) - lens
    return (
        torch.cat([w.a for _, w in pieces]),
        torch.cat([w.b for _, w in pieces], dim=1).contiguous(),
        row_adapter,
        offsets.to(device),
        lens.to(device),
    )


class LoRAManager:
    """The loaded adapters of one model and the wrapping of its layers.

    Args:
        model: the loaded (and quantized) model; its decoder's linear layers are wrapped.
        max_rank: ``--max-lora-rank``.
        max_cpu_loras: adapters kept loaded at once (``--max-cpu-loras``).
        device: where the adapters' weights go (in float32, whatever the activations' dtype:
            the deltas are small matmuls, and float32 keeps them row-invariant on the CPU).
    """

    def __init__(
        self,
        model: nn.Module,
        max_rank: int,
        max_cpu_loras: int,
        device: torch.device,
    ) -> None:
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        self.device = device
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._stacks_key: tuple[int, ...] | None = None  # see step()
        self._stacks: dict = {}
        wrapped = 0
        for path, module in model.named_modules():
            if (
                getattr(module, "quantizable", False)
                and hasattr(module, "output_size")
                and not hasattr(module, "compute_logits")
            ):
                module.quant_method = LoRALinearMethod(module.quant_method, path)
                wrapped += 1
        logger.info(
            "LoRA: %d linear layers take adapters (rank <= %d, %d kept loaded)",
            wrapped,
            max_rank,
            max_cpu_loras,
        )

    def add(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter (validated against the model); ``False`` when that
        adapter (same id and path) is loaded already.

        Raises:
            LoRAAdapterError: the adapter cannot be served (see ``load_adapter``), or its id
                is taken by another adapter.
        """
        loaded = self.adapters.get(request.lora_int_id)
        if loaded is not None:
            if loaded.request.lora_path != request.lora_path:
                raise LoRAAdapterError(
                    f"LoRA adapter {request.lora_name!r}: id {request.lora_int_id} is taken by "
                    f"{loaded.request.lora_name!r}"
                )
            self.adapters.move_to_end(request.lora_int_id)
            return False
        adapter = load_adapter(request, self.model, self.max_rank, torch.float32, self.device)
        self.adapters[request.lora_int_id] = adapter
        self._stacks_key = None
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d, %d layers, %.1f MiB",
            request.lora_name,
            request.lora_path,
            adapter.rank,
            len(adapter.layers),
            adapter.nbytes / 2**20,
        )
        self._evict(keep={request.lora_int_id})
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter; ``False`` when it was not loaded."""
        self._stacks_key = None
        return self.adapters.pop(lora_int_id, None) is not None

    def _evict(self, keep: set[int]) -> None:
        """Drop the least recently used adapters (not in ``keep``) beyond ``max_cpu_loras``."""
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if lora_id not in keep:
                del self.adapters[lora_id]
                self._stacks_key = None

    def step(self, requests: list[LoRARequest | None], query_lens: list[int]) -> LoRAStep | None:
        """The step's :class:`LoRAStep` for sequences with adapters ``requests`` (``None``:
        the base model) of ``query_lens`` tokens each, laid end to end; ``None`` when no
        sequence uses one. An adapter dropped since it was added is read again."""
        rows: dict[int, list[int]] = {}
        by_id: dict[int, LoRARequest] = {}
        start = 0
        for request, n in zip(requests, query_lens):
            if request is not None:
                rows.setdefault(request.lora_int_id, []).extend(range(start, start + n))
                by_id[request.lora_int_id] = request
            start += n
        if not rows:
            return None
        segments = []
        for lora_id, ids in rows.items():
            if lora_id not in self.adapters:
                self.add(by_id[lora_id])
            self.adapters.move_to_end(lora_id)
            index = None if len(ids) == start else torch.tensor(ids, device=self.device)
            segments.append((self.adapters[lora_id], index))
        self._evict(keep=set(rows))
        if start > STACKED_MAX_ROWS:
            return LoRAStep(segments)
        owner = torch.full((start,), -1, dtype=torch.long)
        for i, ids in enumerate(rows.values()):
            owner[ids] = i
        covered = sum(len(ids) for ids in rows.values()) == start
        key = (tuple(rows), tuple(owner.tolist()))
        if self._stacks_key != key:  # the last step's stacks, reused by a step laid out alike
            self._stacks_key, self._stacks = key, {}
        return LoRAStep(
            segments,
            row_adapter=owner.to(self.device),
            adapter_rows=None if covered else (owner >= 0).nonzero().flatten().to(self.device),
            stacks=self._stacks,
        )
