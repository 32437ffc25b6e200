"""The asyncio front of the engine: the engine loop runs in its own thread.

The HTTP server's event loop never runs model code: requests and aborts cross to the engine
thread through a thread-safe queue, and outputs come back into per-request ``asyncio.Queue``s
via ``loop.call_soon_threadsafe``. PyTorch releases the GIL inside its kernels, so the server
stays responsive while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyxllm.config import EngineConfig
from pyxllm.engine.errors import RequestFailedError
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.engine.stat_logger import LoggingStatLogger
from pyxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long the idle engine loop waits for a command before it checks whether it was stopped.
IDLE_POLL_S = 0.5
# How long shutdown() waits for the engine loop to finish its step and exit.
LOOP_JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Engine-loop command: queue ``request``."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Engine-loop command: abort ``request_id`` (unknown ids are ignored)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class StopLoop:
    """Engine-loop command: leave the loop."""


EngineCommand = AddRequest | AbortRequest | StopLoop


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


class AsyncEngine:
    """Runs an ``LLMEngine`` in a background thread and streams its outputs to coroutines.

    Attributes:
        input_processor, tokenizer, model_name, served_model_names, max_model_len: those of
            the engine (the processor is thread-safe: callers process a request, then
            :meth:`generate` it).
        max_num_seqs: the most requests the engine runs at once (``--max-seqs-per-batch``).
        metrics: the engine's :class:`~pyxllm.engine.metrics.EngineMetrics` (thread-safe to scrape).
    """

    def __init__(self, engine: LLMEngine, stats_interval: float | None = None) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.served_model_names = engine.served_model_names
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_seqs_per_batch
        self.metrics = engine.metrics
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._stat_logger = None
        if stats_interval is not None:
            spec = engine.speculative
            self._stat_logger = LoggingStatLogger(
                engine.metrics,
                stats_interval,
                time.monotonic(),
                0 if spec is None else spec.num_speculative_tokens,
            )
        self._thread = threading.Thread(target=self._run, name="pyxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, stats_interval: float | None = None) -> AsyncEngine:
        """Load the model (see ``LLMEngine``) and start the engine thread; with
        ``stats_interval`` (seconds), log the stats line that often while there is work
        (:mod:`pyxllm.engine.stat_logger`)."""
        return cls(LLMEngine(config), stats_interval)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a processed request (see :attr:`input_processor`) and yield its output after
        every step that changed it.

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
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(AddRequest(request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect before the engine's next step)."""
        self._commands.put(AbortRequest(request_id))

    def stats(self) -> dict:
        """The engine's scheduler and KV cache counters."""
        return self.engine.stats()

    def check_health(self) -> None:
        """Raises RuntimeError when the engine loop has died (naming the cause), or a TP worker
        has (``WorkerDiedError``, naming its rank)."""
        self.engine.executor.check_health()
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")

    def fatal_error(self) -> str | None:
        """Why the engine can never serve again (a TP worker died), else ``None``; the server
        exits when it is set."""
        return self.engine.executor.failure

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests get an error), then the TP workers, if any."""
        self._stopped.set()
        self._commands.put(StopLoop())
        self._thread.join(timeout=LOOP_JOIN_TIMEOUT_S)
        self.engine.shutdown()

    def _handle(self, command: EngineCommand) -> None:
        """Apply one command in the engine thread (a :class:`StopLoop` only wakes the loop)."""
        if isinstance(command, AddRequest):
            try:
                self.engine.add_request(command.request)
            except ValueError as e:
                stream = self._streams.get(command.request.request_id)
                if stream is not None:
                    stream.put(e)
        elif isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_id)

    def _drain(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
            )
            self._handle(command)
            while True:
                self._handle(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(time.monotonic())
                if self._stopped.is_set() or not self.engine.has_unfinished_requests():
                    continue
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                for request_id, exc in self.engine.pop_failures().items():
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(RequestFailedError(f"request {request_id} failed: {exc!r}"))
        except BaseException as e:  # the loop must report any failure to every waiting request
            logger.exception("engine loop died")
            self._error = e
            for stream in list(self._streams.values()):
                stream.put(RuntimeError(f"engine loop died: {e!r}"))
