"""The asyncio front of the engine: the engine loop runs in its own thread.

The HTTP server's event loop never runs model code: requests and aborts cross to the engine
thread (:class:`~pyxllm.engine.engine_loop.EngineLoop`) through a thread-safe queue, and
outputs come back into per-request ``asyncio.Queue``s via ``loop.call_soon_threadsafe``.
PyTorch releases the GIL inside its kernels, so the server stays responsive while a step
computes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyxllm.config import EngineConfig
from pyxllm.engine.engine_loop import EngineLoop, load_on_own_thread
from pyxllm.engine.errors import EngineDeadError
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.engine.protocol import EngineClient
from pyxllm.lora_request import LoRARequest
from pyxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long shutdown() waits for the engine loop to finish its step and exit.
LOOP_JOIN_TIMEOUT_S = 10.0


@dataclass(slots=True)
class RequestStream:
    """Where one request's outputs (or the exception that ends it) go: an ``asyncio.Queue``
    read on ``loop``, fed from any thread by :meth:`put`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    @classmethod
    def here(cls) -> RequestStream:
        """A stream read on the running event loop."""
        return cls(asyncio.get_running_loop(), asyncio.Queue())

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the reader (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    async def get(self) -> RequestOutput:
        """The next output; raises the exception put instead of one."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncEngine(EngineClient):
    """Runs an ``LLMEngine`` in a background thread and streams its outputs to coroutines.

    Attributes:
        input_processor, tokenizer, model_name, served_model_names, max_model_len: those of
            the engine (the processor is thread-safe: callers process a request, then
            :meth:`generate` it).
        max_num_seqs: the most requests the engine runs at once (``--max-seqs-per-batch``).
        task: ``--task``: ``generate`` (text) or ``embed`` (embedding requests, whose one
            output is a ``PoolingRequestOutput``).
        data_parallel_size: 1 (one engine; see :mod:`pyxllm.engine.data_parallel` for more).
        metrics: the engine's :class:`~pyxllm.engine.metrics.EngineMetrics` (thread-safe to scrape).
    """

    data_parallel_size = 1

    def __init__(self, engine: LLMEngine, stats_interval: float | None = None) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.served_model_names = engine.served_model_names
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_seqs_per_batch
        self.task = engine.config.task
        self.metrics = engine.metrics
        self.lora_requests = {}  # name -> LoRARequest, see add_lora
        self._streams: dict[str, RequestStream] = {}
        self._loop = EngineLoop(engine, self, stats_interval)

    @classmethod
    def from_config(cls, config: EngineConfig, stats_interval: float | None = None) -> AsyncEngine:
        """Load the model (see ``LLMEngine``) and start the engine thread; with
        ``stats_interval`` (seconds), log the stats line that often while there is work
        (:mod:`pyxllm.engine.stat_logger`). The model loads on a thread of its own
        (:func:`~pyxllm.engine.engine_loop.load_on_own_thread`: one OpenMP team, the engine
        loop's)."""
        return cls(load_on_own_thread(lambda: LLMEngine(config)), stats_interval)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a processed request (see :attr:`input_processor`) and yield its output after
        every step that changed it (an embedding request's one ``PoolingRequestOutput``).

        The last output has ``finished=True``. Closing or cancelling the iterator early aborts
        the request, which frees its KV blocks at the engine's next step.

        Raises:
            ValueError: the ``request_id`` is already in use.
            RuntimeError: the engine loop has died, or (``RequestFailedError``) this request
                failed in the engine and was aborted.
        """
        self.check_health()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream.here()
        self._streams[request_id] = stream
        self._loop.add(request)
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter on the engine's thread, between two steps, then serve it under
        its name (see :class:`~pyxllm.engine.protocol.EngineClient`)."""
        if lora_request.lora_name in self.lora_requests or (
            lora_request.lora_name in self.served_model_names
        ):
            raise ValueError(f"lora_name: {lora_request.lora_name!r} is served already")
        await asyncio.wrap_future(self._loop.call(lambda engine: engine.add_lora(lora_request)))
        self.lora_requests[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> None:
        """Stop serving the adapter named ``lora_name`` and drop it from memory (a request
        still running with it reads it again)."""
        lora_request = self.lora_requests.pop(lora_name)
        lora_id = lora_request.lora_int_id
        await asyncio.wrap_future(self._loop.call(lambda engine: engine.remove_lora(lora_id)))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect before the engine's next step)."""
        self._loop.abort(request_id)

    def stats(self) -> dict:
        """The engine's scheduler and KV cache counters."""
        return self.engine.stats()

    def check_health(self) -> None:
        """Raises RuntimeError when the engine loop has died (naming the cause), or a TP worker
        has (``WorkerDiedError``, naming its rank)."""
        self.engine.executor.check_health()
        if self._loop.error is not None:
            raise RuntimeError(f"engine loop died: {self._loop.error!r}")
        if not self._loop.is_alive():
            raise RuntimeError("engine loop is not running")

    def fatal_error(self) -> str | None:
        """Why the engine can never serve again (a TP worker died), else ``None``; the server
        exits when it is set."""
        return self.engine.executor.failure

    def health_detail(self) -> dict | None:
        """What ``/health`` shows beside its 200 when the engine serves but not fully (a
        data-parallel replica is gone); always ``None`` for one engine."""
        return None

    def fail_requests(self, reason: str) -> None:
        """End every open request with :class:`EngineDeadError` (``reason``): the engine is
        lost (:meth:`fatal_error`) and the server stops next. Its loop may still be blocked in
        the step a dead TP worker broke, so the requests are not left to learn it from there."""
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(f"{reason}; the request was lost"))

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests get an error), then the TP workers, if any."""
        self._loop.stop(LOOP_JOIN_TIMEOUT_S)
        self.engine.shutdown()

    # --- the engine loop's OutputSink (called on its thread) ---------------------------------

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's stream."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def fail(self, request_id: str, exc: Exception) -> None:
        """End a request's stream with ``exc``."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def died(self, exc: BaseException) -> None:
        """End every stream: the engine loop is gone."""
        for stream in list(self._streams.values()):
            stream.put(RuntimeError(f"engine loop died: {exc!r}"))
