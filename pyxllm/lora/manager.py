"""Serving many LoRA adapters on one base model, batched together (``--enable-lora``).

Every linear layer of the decoder (not the LM head or the embedding) gets a
:class:`LoRALinearMethod` around its own ``quant_method``: the base matmul runs once for the
whole step, whatever adapters its rows use, and then one ``kernels.ops.lora_delta`` call adds
each row's own adapter's ``B (A x)`` to its output, in place (vLLM's punica idea, "segmented"
LoRA: rows on one adapter computed together, each adapter's weights read once). Rows without
an adapter keep the base output. So requests on different adapters and on the base model share
every step, prefills and decodes alike.

The deltas are summed in float32 in a fixed order per output (the kernel's contract), so a
row's delta has the same bits whichever rows share its step. The adapters' weights are kept in
bfloat16 when the model runs in bfloat16 (half the bytes a decode step reads), else in float32;
the base weights may be quantized (``--quantization``, a GGUF file's blocks).

Under the graph runner (``GraphRunner``, TorchScript traces on the CPU) a decode step's
adapters are inputs of the trace, as vLLM makes them inputs of its CUDA graphs: the trace takes
``max_loras`` adapter slots per layer (each slot an adapter's ``a``, ``b`` and ``segments``, or
empty tensors) and the row -> slot map, and a replay passes the step's (:meth:`LoRAManager.
graph_inputs`). The kernel reads no shape that the trace could have recorded, so the adapters'
own tensors are passed as they are (no copy into fixed-size slot buffers, which a device graph,
with its recorded addresses, would need): one trace per batch size serves any mix of adapters
and the base model, with the bits of the eager runner.

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
        adapters: the adapters of the step (empty in a traced step, whose ``layers`` are given).
        row_adapter: ``int64 [T]``, each row's position in ``adapters`` (-1: the base model).
        layers: ``{layer path: (a, b, segments)}``, the lists ``lora_delta`` takes for the
            layer (one entry per adapter, empty tensors for an adapter that does not adapt it),
            or ``None`` when none does; filled by the layers as they run and shared by the
            steps with the same adapters in the same order (see :class:`LoRAManager`).
    """

    adapters: list[LoRAAdapter]
    row_adapter: torch.Tensor
    layers: dict = field(default_factory=dict)

    def weights(self, path: str) -> tuple | None:
        """``lora_delta``'s ``(a, b, segments)`` lists for layer ``path``, ``None`` when no
        adapter of the step adapts it."""
        try:
            return self.layers[path]
        except KeyError:
            pass
        found = [adapter.layers.get(path) for adapter in self.adapters]
        if all(w is None for w in found):
            entry = None
        else:
            empty = next(w for w in found if w is not None)
            nothing = (empty.a.new_empty(0, 0), empty.b.new_empty(0), empty.segments[:0])
            entry = tuple(
                [nothing[i] if w is None else (w.a, w.b, w.segments)[i] for w in found]
                for i in range(3)
            )
        self.layers[path] = entry
        return entry


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
        """Whether the base matmul is row-invariant (the deltas always are, on the CPU)."""
        return getattr(self.base, "batch_invariant", False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``base(x) + B (A x)`` on each adapter's rows of ``x [T, in]`` -> ``[T, out]``: the
        base output, added to in place by one ``lora_delta`` call (see the module docstring)."""
        y = self.base.apply(layer, x, bias)
        context = current_forward_context()
        step = None if context is None else context.lora
        if step is None:
            return y
        weights = step.weights(self.path)
        if weights is None:
            return y
        kernels.ops.lora_delta(
            y.view(-1, y.shape[-1]),
            x.reshape(-1, x.shape[-1]).contiguous(),
            *weights,
            step.row_adapter,
        )
        return y


class LoRAManager:
    """The loaded adapters of one model and the wrapping of its layers.

    Args:
        model: the loaded (and quantized) model; its decoder's linear layers are wrapped.
        max_rank: ``--max-lora-rank``.
        max_cpu_loras: adapters kept loaded at once (``--max-cpu-loras``).
        device: where the adapters' weights go.
        dtype: the model's activations' dtype; the adapters' weights are kept in bfloat16 when
            it is bfloat16, else in float32.
        max_loras: most distinct adapters in one step (``--max-loras``): the slots of the graph
            runner's traces.

    Attributes:
        paths: the module paths of the wrapped layers, in the model's order.
    """

    def __init__(
        self,
        model: nn.Module,
        max_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        max_loras: int = 1,
    ) -> None:
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        self.max_loras = max_loras
        self.device = device
        self.weight_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # the last step's adapters (ids in order) and its layers' lists (LoRAStep.layers)
        self._layers_key: tuple[int, ...] | None = None
        self._layers: dict = {}
        self.paths: list[str] = []
        # the graph runner's inputs of the last step's adapters (see graph_inputs)
        self._inputs_key: tuple[int, ...] | None = None
        self._inputs: list[torch.Tensor] = []
        for path, module in model.named_modules():
            if (
                getattr(module, "quantizable", False)
                and hasattr(module, "output_size")
                and not hasattr(module, "compute_logits")
            ):
                module.quant_method = LoRALinearMethod(module.quant_method, path)
                self.paths.append(path)
        logger.info(
            "LoRA: %d linear layers take adapters (rank <= %d, %d kept loaded)",
            len(self.paths),
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
        adapter = load_adapter(request, self.model, self.max_rank, self.weight_dtype, self.device)
        self.adapters[request.lora_int_id] = adapter
        self._layers_key = None
        self._inputs_key = None
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
        self._layers_key = None
        self._inputs_key = None
        return self.adapters.pop(lora_int_id, None) is not None

    def _evict(self, keep: set[int]) -> None:
        """Drop the least recently used adapters (not in ``keep``) beyond ``max_cpu_loras``."""
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if lora_id not in keep:
                del self.adapters[lora_id]
                self._layers_key = None
                self._inputs_key = None

    def step(self, requests: list[LoRARequest | None], query_lens: list[int]) -> LoRAStep | None:
        """The step's :class:`LoRAStep` for sequences with adapters ``requests`` (``None``:
        the base model) of ``query_lens`` tokens each, laid end to end; ``None`` when no
        sequence uses one. An adapter dropped since it was added is read again."""
        owner: list[int | None] = []  # each row's adapter id
        by_id: dict[int, LoRARequest] = {}
        for request, n in zip(requests, query_lens):
            lora_id = None if request is None else request.lora_int_id
            if request is not None:
                by_id[lora_id] = request
            owner.extend([lora_id] * n)
        if not by_id:
            return None
        for lora_id in by_id:
            if lora_id not in self.adapters:
                self.add(by_id[lora_id])
            self.adapters.move_to_end(lora_id)
        self._evict(keep=set(by_id))
        # in id order: the steps of one set of adapters share their layers' lists
        key = tuple(sorted(by_id))
        if self._layers_key != key:
            self._layers_key, self._layers = key, {}
        position = {lora_id: i for i, lora_id in enumerate(key)}
        return LoRAStep(
            [self.adapters[lora_id] for lora_id in key],
            torch.tensor(
                [-1 if i is None else position[i] for i in owner],
                dtype=torch.long,
                device=self.device,
            ),
            self._layers,
        )

    def graph_inputs(self, step: LoRAStep | None) -> list[torch.Tensor]:
        """The adapter slots of ``step`` as the graph runner's trace takes them: for each layer
        of :attr:`paths`, ``max_loras`` ``a``, then as many ``b``, then as many ``segments``
        (slot ``g`` the step's ``g``-th adapter, the ``row_adapter`` value of its rows; an empty
        tensor where there is none or it does not adapt the layer, which the kernel skips).
        ``step=None`` (no adapter in the step) gives all slots empty.

        Raises:
            ValueError: a step of more than ``max_loras`` adapters (the scheduler admits no
                such step).
        """
        adapters = [] if step is None else step.adapters
        if len(adapters) > self.max_loras:
            raise ValueError(
                f"LoRA: a step of {len(adapters)} adapters, above --max-loras {self.max_loras}"
            )
        key = tuple(adapter.request.lora_int_id for adapter in adapters)
        if key == self._inputs_key:
            return self._inputs
        empty_a = torch.empty(0, 0, dtype=self.weight_dtype, device=self.device)
        empty_b = torch.empty(0, dtype=self.weight_dtype, device=self.device)
        empty_seg = torch.empty(0, 5, dtype=torch.long, device=self.device)
        inputs: list[torch.Tensor] = []
        for path in self.paths:
            found = [adapter.layers.get(path) for adapter in adapters]
            found += [None] * (self.max_loras - len(found))
            inputs += [empty_a if w is None else w.a for w in found]
            inputs += [empty_b if w is None else w.b for w in found]
            inputs += [empty_seg if w is None else w.segments for w in found]
        self._inputs_key, self._inputs = key, inputs
        return inputs

    def graph_step(self, row_adapter: torch.Tensor, inputs) -> LoRAStep:
        """The :class:`LoRAStep` a traced decode step runs with: ``row_adapter`` (the step's
        rows' slots, -1 for the base model and the padding) and ``inputs`` laid out as
        :meth:`graph_inputs` makes them (the trace's own inputs, so a replay reads the step's
        adapters, never the ones it was traced with). Every layer calls the kernel, whatever
        the slots hold."""
        n, width = self.max_loras, 3 * self.max_loras
        layers = {
            path: tuple(
                list(inputs[i * width + part * n : i * width + (part + 1) * n]) for part in range(3)
            )
            for i, path in enumerate(self.paths)
        }
        return LoRAStep([], row_adapter, layers)
