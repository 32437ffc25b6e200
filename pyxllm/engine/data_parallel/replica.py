"""A data-parallel replica: a whole engine (scheduler, KV cache, TP group of ``--tp`` ranks) in
its own process, serving the API server over one :mod:`.wire` channel.

:func:`run_replica` is the body whoever places the replica calls (the ``mp`` launcher's spawned
process here; with Ray, an actor, see :mod:`.ray_launcher`): it applies its placement (CPUs,
threads, visible devices), connects back to the API server, loads the engine, then runs an
:class:`~pyxllm.engine.engine_loop.EngineLoop` whose outputs it sends back, one message per
step holding what the step added to each (the server rebuilds the whole outputs), while it
reads requests, aborts and scrapes. A request with a constraint waits in the engine until its
grammar has compiled here, off the engine loop. It stops on the server's stop message
(status 0); when the server's connection closes (the server died) or its engine fails for good
(a TP worker of this replica died), it exits with status 1, after saying why when it can.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

import torch
from prometheus_client import generate_latest

from pyxllm.config import EngineConfig
from pyxllm.engine.data_parallel.wire import (
    AbortMessage,
    AddMessage,
    Channel,
    DeadMessage,
    FailedMessage,
    HelloMessage,
    OutputsMessage,
    ReadyMessage,
    ScrapeMessage,
    ScrapeReply,
    StartFailedMessage,
    StopMessage,
    connect,
)
from pyxllm.engine.errors import ConstraintFailedError, InvalidRequestError
from pyxllm.outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

# How often the idle replica checks that its engine can still serve (seconds).
HEALTH_POLL_S = 0.5
# How long a stopping replica waits for its engine loop's step to end (seconds).
LOOP_JOIN_TIMEOUT_S = 10.0
# Requests whose sent outputs are remembered beyond twice the live ones before the aborted
# ones are forgotten.
PRUNE_SLACK = 64


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What a replica needs to start, picklable (for a spawned process or a Ray actor).

    Attributes:
        config: the engine's configuration (its ``seed`` is ``--seed`` + ``index``, so the
            replicas' unseeded requests draw different numbers).
        index: the replica's number, ``0 .. size - 1``.
        size: ``--data-parallel-size``.
        address: ``(host, port)`` of the API server's listener.
        authkey: the listener's key (never logged).
        threads: torch threads (``None``: leave torch's count).
        cpus: the CPUs to pin the process to (empty: not pinned).
        environ: variables set in the replica's process before its engine is built; torch is
            imported by then, so only variables read when a device is first used take effect
            (an accelerator's visible devices), not those read at import.
        stats_interval: seconds between the engine's stats lines; ``None`` logs none.
    """

    config: EngineConfig
    index: int
    size: int
    address: tuple[str, int]
    authkey: bytes = field(repr=False)
    threads: int | None = None
    cpus: tuple[int, ...] = ()
    environ: tuple[tuple[str, str], ...] = ()
    stats_interval: float | None = None


def apply_placement(spec: ReplicaSpec) -> None:
    """Pin this process to ``spec.cpus``, set its torch threads and its environment; TP
    workers it spawns inherit all three (their share is then computed within these CPUs)."""
    for name, value in spec.environ:
        os.environ[name] = value
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)
    if spec.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        torch.set_num_threads(spec.threads)


class _ChannelSink:
    """The engine loop's :class:`~pyxllm.engine.engine_loop.OutputSink`: everything goes to the
    API server, outputs as deltas (see :class:`~.wire.OutputsMessage`)."""

    def __init__(self, channel: Channel, engine) -> None:
        self.channel, self.engine = channel, engine
        # request id -> completion index -> (characters, tokens) sent; -1 -> prompt logprobs
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}

    def _send(self, message: object) -> None:
        try:
            self.channel.send(message)
        except OSError:  # the server is gone; the main loop sees it and exits
            pass

    def deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """Send what a step added to each output."""
        self._send(OutputsMessage([self._delta(output) for output in outputs]))
        live = self.engine.requests.keys() | self.engine.parents.keys()
        if len(self._sent) > 2 * len(live) + PRUNE_SLACK:  # forget the aborted ones
            self._sent = {rid: sent for rid, sent in self._sent.items() if rid in live}

    def _delta(
        self, output: RequestOutput | PoolingRequestOutput
    ) -> RequestOutput | PoolingRequestOutput:
        """``output`` without what was sent before: its prompt (the server has it), the text,
        tokens and logprobs of earlier steps, the prompt logprobs after the first time. A
        pooling request's one output goes whole, less its prompt."""
        if isinstance(output, PoolingRequestOutput):
            return dataclasses.replace(output, prompt=None, prompt_token_ids=[])
        sent = self._sent.setdefault(output.request_id, {})
        completions = []
        for completion in output.outputs:
            chars, tokens = sent.get(completion.index, (0, 0))
            logprobs = completion.logprobs
            completions.append(
                dataclasses.replace(
                    completion,
                    text=completion.text[chars:],
                    token_ids=completion.token_ids[tokens:],
                    logprobs=None if logprobs is None else logprobs[tokens:],
                )
            )
            sent[completion.index] = (len(completion.text), len(completion.token_ids))
        first = sent.setdefault(-1, (0, 0)) == (0, 0)
        sent[-1] = (1, 1)
        if output.finished:
            del self._sent[output.request_id]
        return dataclasses.replace(
            output,
            prompt=None,
            prompt_token_ids=[],
            outputs=completions,
            prompt_logprobs=output.prompt_logprobs if first else None,
            prompt_logprobs_tensor=output.prompt_logprobs_tensor if first else None,
        )

    def fail(self, request_id: str, exc: Exception) -> None:
        """Say why a request ended without output (refused: a 400; failed: a 500)."""
        self._sent.pop(request_id, None)
        param = exc.param if isinstance(exc, InvalidRequestError) else None
        invalid = isinstance(exc, ValueError)
        constraint = isinstance(exc, ConstraintFailedError)
        self._send(FailedMessage(request_id, str(exc), invalid, param, constraint))

    def died(self, exc: BaseException) -> None:
        """Say the engine loop died (the replica exits next)."""
        self._send(DeadMessage(f"engine loop died: {type(exc).__name__}: {exc}"))


class _Replica:
    """The running replica: its engine, loop and channel (see :func:`run_replica`)."""

    def __init__(self, engine, channel: Channel, stats_interval: float | None) -> None:
        # here, not at the top: the engine's modules load in run_replica, after the placement
        from pyxllm.engine.engine_loop import EngineLoop

        self.engine, self.channel = engine, channel
        self.loop = EngineLoop(engine, _ChannelSink(channel, engine), stats_interval)

    def add(self, message: AddMessage) -> None:
        """Queue the request (a constraint compiles in the engine, which admits the request
        once it has: :meth:`LLMEngine.add_request`)."""
        self.loop.add(message.request)

    def abort(self, message: AbortMessage) -> None:
        """Abort requests (also those still waiting for their grammar)."""
        for request_id in message.request_ids:
            self.loop.abort(request_id)

    def scrape(self, message: ScrapeMessage) -> ScrapeReply:
        """The engine's stats and Prometheus text (both safe to read from this thread)."""
        text = generate_latest(self.engine.metrics.registry).decode()
        return ScrapeReply(message.seq, self.engine.stats(), text)

    def failure(self) -> str | None:
        """Why the engine can never serve again, else ``None``."""
        if self.loop.error is not None:
            return f"engine loop died: {self.loop.error!r}"
        return self.engine.executor.failure

    def serve(self) -> int:
        """Handle the server's messages until it stops this replica (0) or goes away, or the
        engine fails for good (1)."""
        while True:
            if not self.channel.poll(HEALTH_POLL_S):
                failure = self.failure()
                if failure is not None:
                    if self.loop.error is None:  # the loop reported its own death already
                        self.channel.send(DeadMessage(failure))
                    logger.error("%s; exiting", failure)
                    return 1
                continue
            message = self.channel.recv()
            if message is None:
                logger.error("the API server closed the connection (it exited or died); exiting")
                return 1
            if isinstance(message, AddMessage):
                self.add(message)
            elif isinstance(message, AbortMessage):
                self.abort(message)
            elif isinstance(message, ScrapeMessage):
                self.channel.send(self.scrape(message))
            elif isinstance(message, StopMessage):
                return 0

    def shutdown(self) -> None:
        """Stop the engine loop, then the engine (its TP workers, grammar threads)."""
        self.loop.stop(LOOP_JOIN_TIMEOUT_S)
        self.engine.shutdown()


def _exit_if_server_goes(channel: Channel, loaded: threading.Event) -> None:
    """While the engine loads (which may take minutes), end the process at once if the API
    server goes away: it sends nothing before the replica is ready, so anything readable on
    the channel then is its end-of-file."""
    while not loaded.is_set():
        if channel.poll(HEALTH_POLL_S) and not loaded.is_set():
            logger.error("the API server went away while this replica was loading; exiting")
            _exit(1)


def run_replica(spec: ReplicaSpec) -> int:
    """Be replica ``spec.index`` until the API server stops it; returns the exit status (0 when
    stopped, 1 when the server went away or the engine failed for good, or could not load: the
    server is told why first).

    Raises:
        OSError: the API server cannot be reached.
    """
    apply_placement(spec)
    channel = connect(spec.address, spec.authkey)
    replica = None
    try:
        channel.send(HelloMessage(spec.index, os.getpid()))
        loaded = threading.Event()
        watchdog = threading.Thread(
            target=_exit_if_server_goes, args=(channel, loaded), name="pyxllm-dp-watchdog"
        )
        watchdog.start()
        engine, failure = None, None
        try:
            # here, not at the top: they load after the placement is applied, while the
            # watchdog runs, and a failure to import is reported to the server
            from pyxllm.engine.engine_loop import load_on_own_thread
            from pyxllm.engine.llm_engine import LLMEngine

            engine = load_on_own_thread(lambda: LLMEngine(spec.config))
        except Exception as exc:  # noqa: BLE001 - reported to the server, which names it
            logger.debug("replica %d failed to load", spec.index, exc_info=True)
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            loaded.set()
            watchdog.join()
        if failure is not None:
            channel.send(StartFailedMessage(failure))
            return 1
        replica = _Replica(engine, channel, spec.stats_interval)
        channel.send(
            ReadyMessage(engine.executor.num_kv_blocks, torch.get_num_threads(), spec.cpus)
        )
        return replica.serve()
    except OSError:  # the server went away while we talked to it
        logger.error("lost the API server's connection; exiting")
        return 1
    finally:
        if replica is not None:
            replica.shutdown()
        channel.close()


def tag_logs(index: int) -> None:
    """Send pyxllm's log lines (INFO and up) of this process to stderr, tagged ``replica
    index``."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(levelname)s %(asctime)s replica {index} %(name)s: %(message)s")
    )
    root = logging.getLogger("pyxllm")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def replica_main(spec: ReplicaSpec) -> None:
    """Process entry point of a replica spawned by the ``mp`` launcher: log lines tagged
    ``replica i``, Ctrl-C left to the API server (which stops its replicas), then
    :func:`run_replica` and exit with its status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tag_logs(spec.index)
    try:
        code = run_replica(spec)
    except Exception as e:  # noqa: BLE001 - one line, not a traceback; the server names it too
        print(f"error: data-parallel replica {spec.index}: {e}", file=sys.stderr, flush=True)
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """End the process now: multiprocessing's finalizers (semaphores) and the other exit hooks,
    then no interpreter teardown (torch's is slow, and nothing is left to save)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
