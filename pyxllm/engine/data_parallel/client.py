"""The API server's side of data parallelism: :class:`DataParallelEngine` looks like one
:class:`~pyxllm.engine.async_engine.AsyncEngine` to the HTTP handlers, and runs each request on
one of ``--data-parallel-size`` replica processes chosen by the :class:`.Router`.

The server tokenizes and validates requests itself (an
:class:`~pyxllm.engine.frontend.EngineFrontend`, no weights), sends each ``EngineRequest`` to
its replica over that replica's :mod:`.wire` channel, and a reader thread per replica rebuilds
the outputs streamed back (each step's additions) and hands them to the request's queue (vLLM's
engine-core client per replica). Aborts
(a client gone, a stream closed early) go to the replica running the request, which frees its
KV blocks.

A replica that dies (its connection closes) is taken out of rotation: its in-flight requests
fail with :class:`~pyxllm.engine.errors.EngineDeadError` (a 503), the others serve on, and
:meth:`DataParallelEngine.health_detail` says which are gone. Once none is left
:meth:`DataParallelEngine.check_health` raises and :meth:`DataParallelEngine.fatal_error`
names them all (the server answers 503 and exits, as it does when a TP worker dies).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait as wait_for_connections

from pyxllm.config import EngineConfig
from pyxllm.distributed.errors import DistributedError
from pyxllm.engine.async_engine import RequestStream
from pyxllm.engine.data_parallel.launcher import (
    ReplicaHandle,
    ReplicaLauncher,
    default_launcher,
)
from pyxllm.engine.data_parallel.metrics import DataParallelMetrics, total_stats
from pyxllm.engine.data_parallel.replica import ReplicaSpec
from pyxllm.engine.data_parallel.replica_client import InFlightRequest, ReplicaClient
from pyxllm.engine.data_parallel.router import Router
from pyxllm.engine.data_parallel.wire import (
    AbortMessage,
    AddMessage,
    Channel,
    DeadMessage,
    FailedMessage,
    HelloMessage,
    OutputsMessage,
    ReadyMessage,
    ScrapeReply,
    StartFailedMessage,
    StopMessage,
    listen,
)
from pyxllm.engine.errors import (
    ConstraintFailedError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
)
from pyxllm.engine.frontend import EngineFrontend
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.protocol import EngineClient
from pyxllm.outputs import RequestOutput
from pyxllm.pooling_params import POOLING_TASKS

logger = logging.getLogger(__name__)

# Seconds: how often start-up checks that the replicas still live while they load
START_POLL_S = 0.5
# how long a scrape (/metrics, /debug/stats) waits for a replica's answer
SCRAPE_TIMEOUT_S = 5.0
# a dead replica's exit status is waited for this long, to say how it died
EXIT_STATUS_WAIT_S = 1.0
# shutdown: a replica gets this long to exit after its stop message
STOP_WAIT_S = 10.0
# a failed start-up: the other replicas get this long to exit by themselves
START_ABORT_WAIT_S = 5.0


class DataParallelEngine(EngineClient):
    """``size`` engine replicas behind one API server (see the module doc); the handlers use
    it as they use an :class:`~pyxllm.engine.async_engine.AsyncEngine`.

    Args:
        config: every replica's engine configuration (replica ``i`` seeds with ``seed + i``).
        size: ``--data-parallel-size``, at least 1.
        routing: ``--dp-routing`` (see :mod:`.router`).
        stats_interval: seconds between each replica's stats lines in the log; ``None``: none.
        launcher: where replicas run (default: as ``config.distributed_executor_backend``
            says, :func:`~.launcher.default_launcher`: processes on this host, or Ray actors).

    Attributes:
        input_processor, tokenizer, model_name, served_model_names, max_model_len: the front
            door, as :class:`AsyncEngine`'s (the KV-cache check uses the smallest replica's).
        max_num_seqs: the most requests one replica runs at once (``--max-seqs-per-batch``).
        task: what the replicas make (``--task``, ``auto`` resolved for the model): ``generate``,
            or a pooling task whose requests each end with one pooled output.
        data_parallel_size: the number of replicas (dead ones included).
        replicas: the :class:`ReplicaClient` of each.
        router: the :class:`.Router` choosing replicas.
        metrics: ``.registry`` merges the replicas' Prometheus metrics (:mod:`.metrics`).

    Raises:
        ValueError: a bad policy or size (before any replica starts), a model this process
            cannot load the tokenizer of, or a replica's own ``ValueError`` while loading (the
            replicas are stopped first).
        DistributedError: a replica died or failed while starting (naming it).
    """

    def __init__(
        self,
        config: EngineConfig,
        size: int,
        routing: str = "cache_aware",
        stats_interval: float | None = None,
        launcher: ReplicaLauncher | None = None,
    ) -> None:
        Router(size, routing)  # a bad size or policy fails before anything starts
        self.max_num_seqs = config.max_seqs_per_batch
        self.data_parallel_size = size
        self.launcher = launcher or default_launcher(config, size)
        self._requests: dict[str, InFlightRequest] = {}
        self._closing = False
        # the replicas load the model while this process loads the tokenizer
        front, self.replicas = self._start(config, size, stats_interval)
        self.task = front.config.task  # --task auto resolved, as each replica resolves it
        self.lora_requests = {}  # --enable-lora is refused with replicas
        self.tokenizer, self.max_model_len = front.tokenizer, front.max_model_len
        self.served_model_names, self.model_name = front.served_model_names, front.model_name
        num_blocks = min(replica.ready.num_kv_blocks for replica in self.replicas)
        # a pooling model has no grammar to follow (as LLMEngine's front door)
        self.structured_outputs = (
            None if self.task in POOLING_TASKS else front.structured_output_manager()
        )
        self.input_processor = front.input_processor(num_blocks, self.structured_outputs)
        if routing == "cache_aware" and not front.config.enable_prefix_cache:
            logger.info("--dp-routing cache_aware without a prefix cache: least_loaded instead")
            routing = "least_loaded"
        self.router = Router(size, routing, config.block_size, num_blocks)
        self.metrics = DataParallelMetrics(self.scrape)
        for replica in self.replicas:
            threading.Thread(
                target=self._read,
                args=(replica,),
                name=f"pyxllm-dp-reader{replica.index}",
                daemon=True,
            ).start()
        logger.info("data parallel: %d replicas, routing %s", size, routing)

    # --- start-up ---------------------------------------------------------------------------

    def _start(
        self, config: EngineConfig, size: int, stats_interval: float | None
    ) -> tuple[EngineFrontend, list[ReplicaClient]]:
        """Launch the replicas, load this process's front door (the tokenizer) meanwhile, then
        accept their connections and wait until each has loaded its engine."""
        authkey = os.urandom(32)
        listener = listen(self.launcher.listen_host, authkey)
        handles: list[ReplicaHandle] = []
        replicas: dict[int, ReplicaClient] = {}
        try:
            placements = self.launcher.placements(size, config)
            for index, placement in enumerate(placements):
                spec = ReplicaSpec(
                    dataclasses.replace(config, seed=config.seed + index),
                    index,
                    size,
                    listener.address,
                    authkey,
                    placement.threads,
                    placement.cpus,
                    placement.environ,
                    stats_interval,
                )
                handles.append(self.launcher.launch(spec))
            front = EngineFrontend.load(config)
            replicas = self._accept(listener, handles)
            self._wait_ready(replicas)
        except BaseException:
            listener.close()  # replicas that have not connected yet fail to, and exit
            for replica in replicas.values():
                replica.channel.close()  # the others see it and exit
            for handle in handles:
                handle.stop(START_ABORT_WAIT_S)
            raise
        finally:
            listener.close()
        return front, [replicas[i] for i in range(size)]

    def _check_started(self, handles: list[ReplicaHandle], replicas: dict) -> None:
        """Raises DistributedError naming a replica that exited while starting."""
        for index, handle in enumerate(handles):
            how = handle.exit_description()
            if how is not None:
                replica = replicas.get(index)
                said = f": {replica.last_words}" if replica and replica.last_words else ""
                raise DistributedError(
                    f"data-parallel replica {index} exited while starting{how}{said}"
                )

    def _accept(self, listener, handles: list[ReplicaHandle]) -> dict[int, ReplicaClient]:
        """Each replica's connection and hello (an acceptor thread takes the connections, so
        that a replica dying before it connects is noticed)."""
        accepted: queue.SimpleQueue = queue.SimpleQueue()

        def accept() -> None:
            while True:
                try:
                    accepted.put(listener.accept())
                except OSError:  # the listener closed: start-up is over
                    return
                except Exception:  # noqa: BLE001 - a stray client failing the challenge
                    logger.warning("refused a connection that is not a replica", exc_info=True)

        threading.Thread(target=accept, name="pyxllm-dp-accept", daemon=True).start()
        replicas: dict[int, ReplicaClient] = {}
        while len(replicas) < len(handles):
            self._check_started(handles, replicas)
            try:
                conn = accepted.get(timeout=START_POLL_S)
            except queue.Empty:
                continue
            channel = Channel(conn)
            hello = channel.recv() if channel.poll(START_POLL_S * 4) else None
            if not isinstance(hello, HelloMessage) or hello.replica in replicas:
                channel.close()
                continue
            handle = handles[hello.replica]
            replicas[hello.replica] = ReplicaClient(hello.replica, handle, channel, hello.pid)
        return replicas

    def _wait_ready(self, replicas: dict[int, ReplicaClient]) -> None:
        """Wait for every replica's ready message (they load at the same time).

        Raises:
            ValueError / DistributedError: a replica could not load (its message), or died.
        """
        handles = [replicas[i].handle for i in range(len(replicas))]
        waiting = dict(replicas)
        while waiting:
            by_conn = {replica.channel.conn: replica for replica in waiting.values()}
            for conn in wait_for_connections(list(by_conn), timeout=START_POLL_S):
                replica = by_conn[conn]
                message = replica.channel.recv()
                if isinstance(message, ReadyMessage):
                    replica.ready = message
                    del waiting[replica.index]
                    cpus = f" on CPUs {_ranges(message.cpus)}" if message.cpus else ""
                    logger.info(
                        "%s ready: %d KV blocks, %d threads%s",
                        replica.describe(),
                        message.num_kv_blocks,
                        message.threads,
                        cpus,
                    )
                elif isinstance(message, StartFailedMessage):
                    error = f"data-parallel replica {replica.index}: {message.error}"
                    if message.error.startswith(("ValueError", "FileNotFoundError")):
                        raise ValueError(error)
                    raise DistributedError(error)
                elif message is None:
                    how = replica.handle.exit_description(wait=EXIT_STATUS_WAIT_S) or ""
                    raise DistributedError(
                        f"data-parallel replica {replica.index} closed its connection while "
                        f"starting{how}"
                    )
            self._check_started(handles, replicas)

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run a processed request on the replica the router picks and yield its outputs, as
        :meth:`AsyncEngine.generate` does (closing the iterator early aborts it there).

        Raises:
            ValueError: the ``request_id`` is already in use, or the replica refused it
                (``InvalidRequestError``).
            EngineDeadError: no replica is left, or the request's replica died meanwhile.
            RequestFailedError: the request failed in its replica's engine.
        """
        self.check_health()
        request_id = request.request_id
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        decision = self.router.route(request.prompt_token_ids, request.sampling_params.n)
        in_flight = InFlightRequest(request, decision.replica, RequestStream.here())
        self._requests[request_id] = in_flight
        finished = False
        try:
            self.replicas[decision.replica].send(AddMessage(request))
            while not finished:
                output = await in_flight.stream.get()
                finished = output.finished
                yield output
        finally:
            self._forget(request_id, abort=not finished)

    async def add_lora(self, lora_request) -> None:
        """Refused: LoRA adapters are served by one engine (no ``--data-parallel-size``)."""
        raise ValueError("LoRA adapters: not with --data-parallel-size > 1")

    async def remove_lora(self, lora_name: str) -> None:
        """No adapter is ever served here (see :meth:`add_lora`)."""
        raise KeyError(lora_name)

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica, which frees its KV blocks (unknown ids are
        ignored)."""
        self._forget(request_id, abort=True)

    def _forget(self, request_id: str, abort: bool) -> None:
        """Drop a request's bookkeeping (once), release its load and, with ``abort``, tell its
        replica."""
        in_flight = self._requests.pop(request_id, None)
        if in_flight is None:
            return
        self.router.release(in_flight.replica, in_flight.weight)
        replica = self.replicas[in_flight.replica]
        if abort and replica.alive:
            try:
                replica.send(AbortMessage((request_id,)))
            except EngineDeadError:
                pass

    def _read(self, replica: ReplicaClient) -> None:
        """A replica's reader thread: route what it sends until its connection closes."""
        while True:
            message = replica.channel.recv()
            if message is None:
                break
            if isinstance(message, OutputsMessage):
                for output in message.outputs:
                    in_flight = self._requests.get(output.request_id)
                    if in_flight is not None and in_flight.replica == replica.index:
                        in_flight.stream.put(in_flight.merge(output))
            elif isinstance(message, FailedMessage):
                in_flight = self._requests.get(message.request_id)
                if in_flight is not None and in_flight.replica == replica.index:
                    if message.invalid:
                        exc = InvalidRequestError(message.error, message.param)
                    elif message.constraint:
                        exc = ConstraintFailedError(message.error)
                    else:
                        exc = RequestFailedError(message.error)
                    in_flight.stream.put(exc)
            elif isinstance(message, ScrapeReply):
                replica.resolve_scrape(message.seq, message)
            elif isinstance(message, DeadMessage):
                replica.last_words = message.error
        self._replica_died(replica)

    def _replica_died(self, replica: ReplicaClient) -> None:
        """Take a replica whose connection closed out of rotation and fail its requests."""
        if self._closing:
            replica.failure = f"data-parallel replica {replica.index} stopped"
        else:
            how = replica.handle.exit_description(wait=EXIT_STATUS_WAIT_S) or ""
            why = f": {replica.last_words}" if replica.last_words else ""
            replica.failure = f"{replica.describe()} died{how}{why}"
            self.router.remove(replica.index)
            alive = sum(r.alive for r in self.replicas)
            logger.error(
                "%s; %d of %d replicas left", replica.failure, alive, self.data_parallel_size
            )
        lost = EngineDeadError(f"{replica.failure}; the request was lost")
        replica.fail_scrapes(lost)
        for in_flight in list(self._requests.values()):
            if in_flight.replica == replica.index:
                in_flight.stream.put(lost)

    # --- health, stats, shutdown ------------------------------------------------------------

    def check_health(self) -> None:
        """Returns while at least one replica serves.

        Raises:
            EngineDeadError: every replica is gone (naming each and how it ended).
        """
        fatal = self.fatal_error()
        if fatal is not None:
            raise EngineDeadError(fatal)

    def fatal_error(self) -> str | None:
        """Why the server can never serve again (every replica died), else ``None``."""
        if any(replica.alive for replica in self.replicas):
            return None
        return "every data-parallel replica has died: " + "; ".join(
            replica.failure for replica in self.replicas
        )

    def fail_requests(self, reason: str) -> None:
        """End every request still open with :class:`EngineDeadError` (``reason``): no replica
        is left and the server stops next (each replica's own requests failed as it died)."""
        for in_flight in list(self._requests.values()):
            in_flight.stream.put(EngineDeadError(f"{reason}; the request was lost"))

    def health_detail(self) -> dict | None:
        """``None`` while every replica serves; else the degraded state ``/health`` shows:
        ``{"status": "degraded", "data_parallel_size", "replicas_alive", "replicas": [{"replica",
        "alive", "pid", "error"}]}``."""
        alive = sum(replica.alive for replica in self.replicas)
        if alive == self.data_parallel_size:
            return None
        return {
            "status": "degraded" if alive else "dead",
            "data_parallel_size": self.data_parallel_size,
            "replicas_alive": alive,
            "replicas": [
                {"replica": r.index, "alive": r.alive, "pid": r.pid, "error": r.failure}
                for r in self.replicas
            ],
        }

    def scrape(self, timeout: float = SCRAPE_TIMEOUT_S) -> dict[int, ScrapeReply]:
        """Every live replica's stats and metrics (blocking up to ``timeout`` seconds; a
        replica that does not answer in time, or dies meanwhile, is left out)."""
        futures = {r.index: r.start_scrape() for r in self.replicas if r.alive}
        deadline, replies = time.monotonic() + timeout, {}
        for index, future in futures.items():
            try:
                replies[index] = future.result(max(0.0, deadline - time.monotonic()))
            except (FutureTimeout, EngineDeadError):
                logger.warning("data-parallel replica %d did not answer a scrape", index)
        return replies

    def stats(self) -> dict:
        """``/debug/stats``: the replicas' counters summed (the keys of ``LLMEngine.stats()``),
        ``data_parallel_size``, ``replicas_alive`` and ``replicas``: per replica its index,
        ``alive``, ``pid``, with Ray its actor's ``node_id`` and ``node_ip``, the router's
        ``routed_requests`` and ``load`` (requests sent and not finished) and its own counters
        (``error`` instead when it is gone). Blocks for the replicas' answers."""
        replies = self.scrape()
        per_replica = []
        for replica in self.replicas:
            entry = {"replica": replica.index, "alive": replica.alive, "pid": replica.pid}
            node = replica.handle.node()
            if node is not None:
                entry["node_id"], entry["node_ip"] = node["node_id"], node["node_ip"]
            entry["routed_requests"] = self.router.num_routed[replica.index]
            entry["load"] = self.router.loads[replica.index]
            if replica.index in replies:
                entry.update(replies[replica.index].stats)
            elif not replica.alive:
                entry["error"] = replica.failure
            per_replica.append(entry)
        return {
            **total_stats([reply.stats for reply in replies.values()]),
            "data_parallel_size": self.data_parallel_size,
            "replicas_alive": sum(replica.alive for replica in self.replicas),
            "replicas": per_replica,
        }

    def shutdown(self) -> None:
        """Stop every replica (stop message, then force after a while) and the grammar
        threads; requests still running get an error."""
        self._closing = True
        for replica in self.replicas:
            if replica.alive:
                try:
                    replica.send(StopMessage())
                except EngineDeadError:
                    pass
        for replica in self.replicas:
            replica.handle.stop(STOP_WAIT_S)
            replica.channel.close()
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()


def _ranges(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)
