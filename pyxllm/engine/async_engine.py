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
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyxllm.config import EngineConfig
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.outputs import RequestOutput
from pyxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5


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
        tokenizer, model_name, max_model_len, generation_defaults: those of the engine.
        metrics: the engine's :class:`~pyxllm.engine.metrics.EngineMetrics` (thread-safe to scrape).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults
        self.metrics = engine.metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (see ``LLMEngine``) and start the engine thread."""
        return cls(LLMEngine(config))

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its output after every step that changed it.

        The last output has ``finished=True``. Closing or cancelling the iterator early aborts
        the request, which frees its KV blocks at the engine's next step.

        Raises:
            ValueError: the request is invalid (e.g. too long for ``max_model_len``).
            RuntimeError: the engine loop has died.
        """
        self.check_health()
        self.engine.validate_request(prompt_token_ids, sampling_params)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", (request_id, prompt_token_ids, sampling_params, prompt)))
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
        self._commands.put(("abort", request_id))

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
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            request_id = payload[0]
            try:
                self.engine.add_request(*payload)
            except ValueError as e:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(e)
        elif kind == "abort":
            self.engine.abort_request(payload)

    def _drain(self, block: bool) -> None:
        try:
            kind, payload = (
                self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
            )
            self._handle(kind, payload)
            while True:
                kind, payload = self._commands.get_nowait()
                self._handle(kind, payload)
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stopped.is_set() or not self.engine.has_unfinished_requests():
                    continue
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
        except BaseException as e:  # the loop must report any failure to every waiting request
            logger.exception("engine loop died")
            self._error = e
            for stream in list(self._streams.values()):
                stream.put(RuntimeError(f"engine loop died: {e!r}"))
