"""The graph runner: decode steps captured once per batch-size bucket and replayed.

Device-neutral: bucket choice, the static input buffers and the padding live in
:class:`GraphRunner`; the capture itself is pluggable. :class:`DeviceGraphCapture` records CUDA
graphs (``torch.cuda.CUDAGraph``) or ACL graphs (``torch.npu.NPUGraph``); :class:`TraceCapture`
records the CPU's decode step as a TorchScript graph; :class:`EagerCapture` replays by running
the padded batch eagerly (a stand-in that tests the padding alone).

A decode batch of ``n`` sequences runs in the smallest bucket ``b >= n`` (1, 2, 4, 8, then
multiples of 16 up to ``--max-seqs-per-batch``). Rows ``n..b`` are padding: token 0 at
position 0, slot -1 (the cache write skips it), a context of 1 token in block 0 (finite,
discarded output). Steps with a prefill, or more sequences than the largest bucket, run eagerly.

Speculative decoding's verification steps replay too, without captures of their own: a
sequence verifying ``k`` drafts is ``1 + k`` decode rows, row ``j`` the token at position ``p_j``
with a context of ``p_j + 1`` tokens over the sequence's block table. Every layer writes the
step's K/V into the cache before it attends, so row ``j`` sees the drafts before it and none
after: the causal attention of a ``1 + k``-token query, computed by the decode kernel that
decoding without speculation uses (vLLM's FlashInfer and TRT-LLM paths treat short speculative
queries as decodes the same way).

LoRA adapters (``--enable-lora``) replay too: each captured step takes the rows' adapter slots
and the slots' weights as inputs (see ``pyxllm.lora.manager``), as vLLM's CUDA graphs take
its LoRA slots' buffers, so one capture per bucket serves any mix of adapters and the base
model. Each bucket is also captured without adapters, and a step whose rows all run the base
model replays that one: the same bits (a row without an adapter gets no delta either way),
without the adapter slots' inputs and the kernel calls over empty slots.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from pyxllm.attention.abstract import AttentionBackend
from pyxllm.executor.input_batch import segment_ids
from pyxllm.executor.runners.base import Runner
from pyxllm.executor.thread_tuner import one_thread
from pyxllm.layers.forward_context import ForwardContext, set_forward_context


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then multiples of 16, up to ``max_batch`` (which ends the list).

    ``capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]``; ``capture_sizes(20) == [1, 2, 4, 8, 16,
    20]``.
    """
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return [*sizes, max_batch]


# A capture turns ``fn(*args)`` (the decode step over the static buffers and the KV caches, all
# in ``args``) into a replay: ``replay(args)`` reruns it. A capture whose ``takes_inputs`` is
# true runs it on the tensors it is given (tensors of other shapes may stand where the step only
# passes them to a kernel: the LoRA adapters' slots); a device graph reruns it on the tensors it
# recorded, whatever it is given.
StepFn = Callable[..., torch.Tensor]
Replay = Callable[[tuple[torch.Tensor, ...]], torch.Tensor]


class EagerCapture:
    """The stand-in: "capturing" keeps the function, and a replay runs it again eagerly."""

    takes_inputs = True

    def capture(self, fn: StepFn, args: tuple[torch.Tensor, ...]) -> Replay:
        return lambda step_args: fn(*step_args)


class TraceCapture:
    """The CPU's capture: ``torch.jit.trace`` records the decode step's ops once, and a replay
    runs them from TorchScript's C++ interpreter, without the ~2.5 ms of Python a step that
    SmolLM2's 30 layers cost eagerly (about 25 % of a batch-1 int4 step on 2 cores;
    docs/performance.md). CUDA graphs play this role on a GPU; on a CPU nothing else replays a
    recorded step (``torch.compile`` keeps dynamo's guards and the Python attention op, and was
    slower).

    The static buffers and the KV caches are the traced function's inputs, not constants: a
    replay reads the copied inputs, and TorchScript keeps the cache writes (a write into a
    captured constant is dropped by its optimizer from the third call on). What a trace cannot
    record is refused where the runner is built: collectives (tensor parallelism) and layers
    that run Python on the data (MoE routing).
    TorchScript is in maintenance upstream; ``torch.export`` with AOTInductor is the successor
    to move to once it can replay a paged-attention step as cheaply.
    """

    takes_inputs = True

    def capture(self, fn: StepFn, args: tuple[torch.Tensor, ...]) -> Replay:
        # one thread: a capture is mostly TorchScript's own work and steps of a few rows (the
        # 8 captures of SmolLM2's start-up: ~60 s on 2 threads with the cores busy, 6.5 s on
        # one); a replay runs on the caller's threads (a trace records ops, not thread counts)
        with one_thread():
            fn(*args)  # warm-up: lazy initialisation must not be recorded
            with (
                warnings.catch_warnings()
            ):  # TracerWarnings about Python values: the step has none that vary
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(fn, args, check_trace=False)
            # TorchScript's profiling executor runs a graph unoptimized while it profiles it
            # (the first two calls: ~150-250 ms each for SmolLM2, against ~35 after), so those
            # calls are made here, at start-up, not by the first requests (the static buffers
            # hold padding: slot -1, nothing is written to the caches)
            for _ in range(2):
                traced(*args)
        return lambda step_args: traced(*step_args)


class DeviceGraphCapture:
    """Records ``fn`` as a device graph; a replay re-runs it on the same static buffers.

    Args:
        device_module: ``torch.cuda`` or ``torch.npu`` (same graph API).
        graph_class: ``CUDAGraph`` or ``NPUGraph``.
        warmup: eager runs before each capture (lazy library initialisation must not be captured).

    Untested here (no accelerator on the development machines); ``pyxllm check-device`` checks
    graph tokens against eager ones on a card.
    """

    takes_inputs = False  # a replay reads the buffers it recorded

    def __init__(self, device_module: ModuleType, graph_class: str, warmup: int = 2) -> None:
        self.device_module, self.graph_class, self.warmup = (
            device_module,
            getattr(device_module, graph_class),
            warmup,
        )
        self.pool = (
            device_module.graph_pool_handle()
        )  # shared by every bucket, largest captured first

    def capture(self, fn: StepFn, args: tuple[torch.Tensor, ...]) -> Replay:
        for _ in range(self.warmup):
            fn(*args)
        self.device_module.synchronize()
        graph = self.graph_class()
        with self.device_module.graph(graph, pool=self.pool):
            out = fn(*args)
        self.device_module.synchronize()

        def replay(step_args: tuple[torch.Tensor, ...]) -> torch.Tensor:
            graph.replay()
            return out

        return replay


class GraphRunner(Runner):
    """Replays captured decode steps; runs everything else eagerly.

    Args:
        model: the model (``forward(input_ids [T], positions [T]) -> [T, hidden]``).
        attn_backend: the executor's attention backend; its ``build_decode`` makes the captured
            steps' attention metadata over the static buffers.
        kv_caches: per layer ``(k_cache, v_cache)``.
        max_batch: the largest bucket (``--max-seqs-per-batch``).
        max_model_len: longest context in tokens; captured attention spans this many.
        block_size: tokens per KV block.
        capture: a :class:`DeviceGraphCapture` or :class:`EagerCapture`.
        max_query_len: the longest query of a sequence that replays (as that many decode rows;
            ``1 + num_speculative_tokens`` with speculative decoding, else 1); it is a bucket
            too.
        lora: the ``LoRAManager`` of ``--enable-lora``: every captured step then takes the row ->
            adapter map and the adapters' slots (``LoRAManager.graph_inputs``) as inputs too,
            and a replay passes the step's (set by the executor in :attr:`lora_step`); needs a
            capture that ``takes_inputs``.

    Attributes:
        sizes: the buckets, ascending; replays: bucket -> how many steps replayed in it.
        lora_step: the next step's ``LoRAStep`` (``None``: no row uses an adapter).
        plain_graphs: with ``lora``, bucket -> the capture without adapters, which steps whose
            rows all run the base model replay (``graphs`` holds the captures with them);
            ``plain_replays`` counts those steps per bucket.

    Raises:
        ValueError: a model with layers that run Python on the data; ``lora`` with a capture
            that does not take inputs.
    """

    name = "graph"

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        kv_caches,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        capture,
        max_query_len: int = 1,
        lora=None,
    ) -> None:
        uncapturable = sorted(
            {type(m).__name__ for m in model.modules() if not getattr(m, "capturable", True)}
        )
        if uncapturable:
            raise ValueError(
                f"--graph-backend graph cannot capture {type(model).__name__}: its "
                f"{', '.join(uncapturable)} runs Python on the data; use --graph-backend eager"
            )
        if lora is not None and not capture.takes_inputs:
            raise ValueError(
                f"--enable-lora: the graph runner's {type(capture).__name__} replays the "
                "adapters it recorded; use --graph-backend eager"
            )
        super().__init__(model)
        self.attn_backend, self.kv_caches = attn_backend, kv_caches
        self.lora, self.lora_step = lora, None
        self.max_query_len = max_query_len
        # and a bucket of exactly one sequence verifying its drafts (padding it to the next
        # power of two would add rows to every matmul of the step)
        self.sizes = sorted({*capture_sizes(max_batch), min(max_query_len, max_batch)})
        max_blocks = -(-max_model_len // block_size)
        self.max_seq_len = max_blocks * block_size
        device, size = kv_caches[0][0].device, self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.long, device=device)
        self.row_adapter = torch.full((size,), -1, dtype=torch.long, device=device)
        # on the CPU the padding writes through numpy views of the buffers: a slice assignment
        # costs ~1 us there against ~5-8 for a torch op (after a step has streamed the weights
        # through the caches), and a batch-1 step makes about ten of them
        self._host = device.type == "cpu"
        self._buffers = tuple(
            t.numpy() if self._host else t
            for t in (
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.seq_lens,
                self.block_tables,
            )
        )
        self._static_args: dict[int, tuple[torch.Tensor, ...]] = {}
        with torch.inference_mode():
            self.graphs = {
                s: capture.capture(self._decode_step, self._step_args(s))
                for s in reversed(self.sizes)
            }
            self.plain_graphs = (
                {}
                if lora is None
                else {
                    s: capture.capture(self._decode_step, self._step_args(s, lora=False))
                    for s in reversed(self.sizes)
                }
            )
        self.replays = dict.fromkeys(self.sizes, 0)
        self.plain_replays = dict.fromkeys(self.sizes, 0)

    def _step_args(self, size: int, lora: bool = True) -> tuple[torch.Tensor, ...]:
        """The inputs of a ``size``-row decode step: views of the static buffers' first ``size``
        rows, then every layer's ``k_cache, v_cache``; with LoRA (unless ``lora`` is false: the
        step without adapters), then the rows' adapter slots and the adapters of
        :attr:`lora_step` (``LoRAManager.graph_inputs``)."""
        args = self._static_args.get(size)
        if args is None:
            args = self._static_args[size] = (
                self.input_ids[:size],
                self.positions[:size],
                self.slot_mapping[:size],
                self.block_tables[:size],
                self.seq_lens[:size],
                *itertools.chain.from_iterable(self.kv_caches),
            )
        if self.lora is None or not lora:
            return args
        return (*args, self.row_adapter[:size], *self.lora.graph_inputs(self.lora_step))

    def _decode_step(
        self, input_ids, positions, slot_mapping, block_tables, seq_lens, *rest
    ) -> torch.Tensor:
        """The model forward of one decode step over :meth:`_step_args` (with the adapters'
        inputs or without them)."""
        step = self.attn_backend.build_decode(
            slot_mapping, block_tables, seq_lens, self.max_seq_len
        )
        caches = rest[: 2 * len(self.kv_caches)]
        lora = None
        if len(rest) > len(caches):
            lora = self.lora.graph_step(rest[len(caches)], rest[len(caches) + 1 :])
        context = ForwardContext(step, list(zip(caches[0::2], caches[1::2])), lora=lora)
        with set_forward_context(context):
            return self.model(input_ids, positions)

    def bucket_for(self, batch) -> int | None:
        """The bucket an ``InputBatch`` replays in (one row per token); ``None`` when it must
        run eagerly (a prefill chunk, even a short one: prefills attend through the prefill
        kernel, as without speculation; a query longer than ``max_query_len``, more tokens than
        the largest bucket, a context longer than the captured one, or mRoPE positions: the
        captures read the tokens' indices). A decode step never carries key limits (a token of
        an image attended bidirectionally that sees later ones is never a chunk's only token),
        so the captures, which attend causally, serve every step they take."""
        n = sum(batch.query_lens)
        if (
            not batch.decodes_only
            or batch.mrope_positions is not None
            or n > self.sizes[-1]
            or max(batch.query_lens) > self.max_query_len
            or max(batch.seq_lens_list) > self.max_seq_len
        ):
            return None
        return next(s for s in self.sizes if s >= n)

    def pad_inputs(self, batch, size: int) -> None:
        """Copy a batch of ``n`` tokens into the static buffers' first ``n`` rows, one decode
        row per token (context ``position + 1`` over its sequence's block table), and pad rows
        ``n..size`` (token 0, position 0, slot -1, context 1, block table of zeros)."""
        n, width = len(batch.input_ids), batch.block_tables.shape[1]
        tables = batch.block_tables
        if n != len(batch.query_lens):  # some sequence verifies drafts: a row per token
            tables = tables.index_select(0, segment_ids(batch.query_lens).to(tables.device))
        source = (lambda t: t.numpy()) if self._host else (lambda t: t)  # noqa: E731
        input_ids, positions, slot_mapping, seq_lens, block_tables = self._buffers
        input_ids[:n] = source(batch.input_ids)
        positions[:n] = step_positions = source(batch.positions)
        slot_mapping[:n] = source(batch.slot_mapping)
        seq_lens[:n] = step_positions + 1
        block_tables[:n, :width] = source(tables)
        block_tables[:n, width:] = 0
        if n < size:
            input_ids[n:size] = 0
            positions[n:size] = 0
            slot_mapping[n:size] = -1
            seq_lens[n:size] = 1
            block_tables[n:size] = 0
        if self.lora_step is not None:  # (a step without adapters replays without them)
            self.row_adapter[:n].copy_(self.lora_step.row_adapter)
            self.row_adapter[n:size].fill_(-1)

    @torch.inference_mode()
    def execute(self, batch, make_context) -> torch.Tensor:
        """Hidden states ``[T, hidden]``; a replay's are a view of the graph's output buffer,
        valid until the next replay."""
        size = self.bucket_for(batch)
        if size is None or batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return super().execute(batch, make_context)
        self.pad_inputs(batch, size)
        if self.lora is not None and self.lora_step is None:  # every row on the base model
            self.plain_replays[size] += 1
            return self.plain_graphs[size](self._step_args(size, lora=False))[
                : len(batch.input_ids)
            ]
        self.replays[size] += 1
        return self.graphs[size](self._step_args(size))[: len(batch.input_ids)]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)
