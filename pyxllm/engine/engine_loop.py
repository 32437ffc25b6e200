"""The engine loop: one thread stepping an :class:`LLMEngine` while there is work, fed by a
thread-safe command queue, its results handed to an :class:`OutputSink`.

The API server's :class:`~pyxllm.engine.async_engine.AsyncEngine` runs one in its own process
(the sink puts outputs into per-request asyncio queues); a data-parallel replica runs one in
its process (the sink sends them to the API server: :mod:`pyxllm.engine.data_parallel`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pyxllm.engine.errors import RequestFailedError
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.engine.stat_logger import LoggingStatLogger
from pyxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long the idle engine loop waits for a command before it checks whether it was stopped.
IDLE_POLL_S = 0.5

T = TypeVar("T")


def load_on_own_thread(load: Callable[[], T]) -> T:
    """Run ``load`` (e.g. ``lambda: LLMEngine(config)``) on a thread of its own that ends
    with it, and return what it returned; what it raised is raised here.

    Why: OpenMP (libgomp, as torch's CPU wheels ship it) keeps a team of worker threads for each
    thread that has run a parallel region, and once it manages more threads than there are
    CPUs its workers stop spinning between regions (its throttled spin count), so each of a
    step's few hundred parallel regions waits for a worker to wake. A model loaded (weights,
    quantization, graph capture) on the main thread and stepped on the engine loop's made two
    teams: an 8-sequence w8a8 decode step of the default model took 32 ms on 2 cores instead of
    19. A thread's team goes when the thread ends, so after this the engine loop's thread is
    the only one with a team (the API server's event loop runs no parallel regions).
    """
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(load())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    # a daemon: Ctrl-C during a load interrupts the join and the process exits without it
    thread = threading.Thread(target=run, name="pyxllm-load", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


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


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Engine-loop command: ``fn(engine)`` between two steps, its result (or exception) into
    ``future`` (loading a LoRA adapter: only the loop's thread touches the engine)."""

    fn: Callable[[LLMEngine], Any]
    future: Future


EngineCommand = AddRequest | AbortRequest | StopLoop | CallEngine


class OutputSink(Protocol):
    """Where an :class:`EngineLoop` sends what happens to requests (called on the loop's
    thread)."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """The outputs of one step (of requests that got tokens, finished or not)."""

    def fail(self, request_id: str, exc: Exception) -> None:
        """A request refused by the engine (``ValueError``: its id is in use, its constraint
        does not compile) or failed in it (:class:`RequestFailedError`); it gets no more
        output."""

    def died(self, exc: BaseException) -> None:
        """The loop itself failed (a step raised, e.g. a TP worker died) and has stopped."""


class EngineLoop:
    """Steps ``engine`` on a daemon thread while it has unfinished requests.

    Args:
        engine: the engine; only this loop's thread touches it once started (but for
            ``stats()``, which is safe to read from another thread).
        sink: receives outputs, failures and the loop's death.
        stats_interval: seconds between the stats lines in the log
            (:mod:`pyxllm.engine.stat_logger`) while there is work; ``None`` logs none.
    """

    def __init__(
        self, engine: LLMEngine, sink: OutputSink, stats_interval: float | None = None
    ) -> None:
        self.engine, self.sink = engine, sink
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
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

    def add(self, request: EngineRequest) -> None:
        """Queue ``request`` (thread-safe; it joins the batch at the next step)."""
        self._commands.put(AddRequest(request))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect before the engine's next step)."""
        self._commands.put(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """``fn(engine)`` on the loop's thread between two steps (thread-safe); its result or
        exception in the returned future."""
        future: Future = Future()
        self._commands.put(CallEngine(fn, future))
        return future

    def is_alive(self) -> bool:
        """Whether the loop's thread still runs."""
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Ask the loop to leave and wait up to ``timeout`` seconds for its step to end."""
        self._stopped.set()
        self._commands.put(StopLoop())
        self._thread.join(timeout=timeout)

    def _handle(self, command: EngineCommand) -> None:
        """Apply one command in the engine thread (a :class:`StopLoop` only wakes the loop)."""
        if isinstance(command, AddRequest):
            try:
                self.engine.add_request(command.request)
            except ValueError as e:
                self.sink.fail(command.request.request_id, e)
        elif isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, CallEngine):
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller gets it
                command.future.set_exception(e)

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
        engine = self.engine
        try:
            while not self._stopped.is_set():
                self._drain(block=not engine.has_unfinished_requests())
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(time.monotonic())
                if self._stopped.is_set() or not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                if outputs:
                    self.sink.deliver(outputs)
                for request_id, exc in engine.pop_failures().items():
                    if not isinstance(exc, RequestFailedError):
                        exc = RequestFailedError(f"request {request_id} failed: {exc!r}")
                    self.sink.fail(request_id, exc)
        except BaseException as e:  # the loop must report any failure to every waiting request
            logger.exception("engine loop died")
            self.error = e
            self.sink.died(e)
