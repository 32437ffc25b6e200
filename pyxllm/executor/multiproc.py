"""Tensor parallelism across processes: rank 0's executor drives one executor per worker rank.

Launch (see ``EngineConfig``):

- ``--tensor-parallel-size N`` on one host: rank 0 spawns ranks ``1..N-1`` (multiprocessing's
  ``spawn`` context) meeting at ``--master-addr`` or ``127.0.0.1:<free port>``; the CPU's cores
  are split between the N ranks.
- ``--nnodes N --node-rank i --master-addr host:port``: one rank per node, started by hand as
  xLLM does; node 0 builds this executor (and serves HTTP), the others run
  :func:`pyxllm.executor.worker.run_worker`.

A step: rank 0 encodes the scheduler's plan (:mod:`~pyxllm.executor.plan_codec`, a few bytes per
decoding sequence), sends it down the control channel (:mod:`pyxllm.distributed.control`), and
runs its own :class:`ModelExecutor` on the plan; the workers run the same forward, so the
layers' all-reduces pair up; the LM head's logits are gathered to rank 0, which alone samples.
Every rank allocates the same number of KV blocks (the smallest any rank can afford).

Faults: a worker whose control connection closes (it died) or that reports an error sets
:attr:`MultiprocExecutor.failure` ("TP worker rank i died ..."); the next step, or the one in
flight once its collective fails, raises :class:`WorkerDiedError`, and ``check_health`` raises it
too. :meth:`MultiprocExecutor.shutdown` sends the workers a stop message, then terminates
spawned ones that have not exited within a few seconds.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time

import torch

from pyxllm.config import EngineConfig
from pyxllm.distributed.control import ControlServer
from pyxllm.distributed.parallel_state import (
    DistributedError,
    destroy_distributed,
    init_distributed,
    parse_master_addr,
    tp_state,
)
from pyxllm.executor.abstract import Executor
from pyxllm.executor.messages import StopMessage, to_wire
from pyxllm.executor.model_executor import ModelExecutor, StepResult
from pyxllm.executor.plan_codec import PlanEncoder
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.executor.worker import worker_main
from pyxllm.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

# Waits, in seconds (the ranks' start-up is bounded by --dist-init-timeout instead):
# the watcher waits this long for a dead worker's exit status, to say how it died
EXIT_STATUS_WAIT_S = 1.0
# a broken collective: this long for the watcher to name the rank that died, polling this often
FAILURE_NAMING_WAIT_S = 2.0
FAILURE_POLL_S = 0.05
# shutdown: a spawned worker gets this long to exit after the stop message, then as long again
# after SIGTERM before SIGKILL
STOP_WAIT_S = 5.0
TERMINATE_WAIT_S = 2.0


class WorkerDiedError(DistributedError):
    """A TP worker died or failed; the message names its rank."""


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_tp_fits(model_config, platform, tp_size: int, model_impl: str = "auto") -> None:
    """Build the model for TP rank 0 of ``tp_size`` on the meta device (no memory, no processes),
    so a model that does not split fails before any rank starts.

    Raises:
        ValueError: e.g. "--tensor-parallel-size 2: does not fit 9 attention heads and 3 KV
            heads ...".
    """
    model_cls = resolve_model_class(model_config, platform.name, model_impl)
    with tp_state(0, tp_size), torch.device("meta"):
        model_cls(model_config)


def describe_exit(code: int | None) -> str:
    """How a process with exit status ``code`` ended, as `` (exit code 1)`` or
    `` (killed by SIGKILL)``; empty while it runs (``None``)."""
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" (exit code {code})"


def stop_process(proc: multiprocessing.Process, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``proc`` to exit (it was asked to), then SIGTERM it
    and wait ``TERMINATE_WAIT_S`` more, then SIGKILL it."""
    proc.join(timeout=timeout)
    if proc.exitcode is None:
        proc.terminate()
        proc.join(timeout=TERMINATE_WAIT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join(timeout=TERMINATE_WAIT_S)


class MultiprocExecutor(Executor):
    """Rank 0's :class:`~pyxllm.executor.abstract.Executor` under tensor parallelism (vLLM's
    ``MultiprocExecutor``): runs each step on its own rank's :attr:`driver` after sending the
    plan to the workers, and watches them.

    Attributes:
        failure: ``None`` while every worker lives, else the message naming the failed rank.
        procs: rank -> spawned ``multiprocessing.Process`` (empty when launched by hand).
        placed: how the workers were placed, in words (for the start-up log line).
        driver: rank 0's :class:`ModelExecutor`; ``dtype``, ``num_kv_blocks`` are its.

    Raises:
        ValueError: the model does not split ``world_size`` ways (before any process starts).
        DistributedError: a rank did not join within ``--dist-init-timeout``, or died starting.
    """

    # what rank 0 advises when the other ranks do not join in time (None: init_distributed's)
    join_hint: str | None = None

    def __init__(self, config: EngineConfig, model_config, source, platform) -> None:
        self.world_size, self.failure, self.procs = config.world_size, None, {}
        self.channel, self._closed = None, False
        check_tp_fits(model_config, platform, self.world_size, config.model_impl)
        self._threads = torch.get_num_threads()
        try:
            master, threads, local_rank = self._start_workers(config, platform)
            store = init_distributed(
                platform,
                0,
                self.world_size,
                master,
                config.dist_init_timeout,
                local_rank,
                check_alive=self.check_health,
                join_hint=self.join_hint,
            )
            torch.set_num_threads(threads)
            self.channel = ControlServer(
                parse_master_addr(master)[0],
                store,
                self.world_size,
                config.dist_init_timeout,
                check_alive=self.check_health,
            )
            self.channel.watch(self._on_worker_failure)
            self.driver = ModelExecutor(config, model_config, source, platform)
            self.model_config, self.dtype = model_config, self.driver.dtype
            self.num_kv_blocks = self.driver.num_kv_blocks
        except BaseException as e:
            collective_broke = isinstance(e, RuntimeError) and not isinstance(e, DistributedError)
            if collective_broke and self._wait_for_failure():
                self.shutdown()
                raise WorkerDiedError(self.failure) from e
            self.shutdown()
            raise
        self.encoder = PlanEncoder(self.driver.encoder_cache)
        logger.info("tensor parallel: %d ranks at %s (%s)", self.world_size, master, self.placed)

    def _start_workers(self, config: EngineConfig, platform) -> tuple[str, int, int]:
        """Start ranks ``1..N-1`` (spawned here; with ``--nnodes`` they are started by hand) and
        set :attr:`placed` (how, in words).

        Returns:
            ``(master address, rank 0's torch threads, rank 0's local rank)``.
        """
        spawn = config.nnodes == 1
        if spawn and (warning := platform.tp_cores_warning(self.world_size)):
            logger.warning("%s", warning)
        master = config.master_addr or f"127.0.0.1:{free_local_port()}"
        self.placed = "spawned here" if spawn else "one per node"
        if spawn:
            self._spawn(config, master)
        return master, platform.threads_per_rank(self.world_size if spawn else 1), 0

    def _spawn(self, config: EngineConfig, master: str) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in range(1, self.world_size):
            proc = context.Process(
                target=worker_main,
                name=f"pyxllm-tp-rank{rank}",
                daemon=True,
                kwargs=dict(
                    config=config,
                    rank=rank,
                    world_size=self.world_size,
                    master_addr=master,
                    local_rank=rank,
                    local_world_size=self.world_size,
                    spawned=True,
                ),
            )
            proc.start()
            self.procs[rank] = proc

    def _on_worker_failure(self, rank: int, error: str | None) -> None:
        """Called by the control channel's watcher thread: record which rank failed and how."""
        how = f"failed: {error}" if error else "died" + self._exit_detail(rank)
        if self.failure is None:
            self.failure = f"TP worker rank {rank}{self._whereabouts(rank)} {how}"
            logger.error(self.failure)

    def _exit_detail(self, rank: int) -> str:
        """How worker ``rank`` ended, e.g. `` (killed by SIGKILL)``, once it has (waiting up to
        ``EXIT_STATUS_WAIT_S``); empty when unknown (a rank started by hand)."""
        proc = self.procs.get(rank)
        if proc is None:
            return ""
        proc.join(timeout=EXIT_STATUS_WAIT_S)
        return describe_exit(proc.exitcode)

    def _whereabouts(self, rank: int) -> str:
        """Where worker ``rank`` runs, e.g. `` (pid 1234)``; empty when unknown."""
        proc = self.procs.get(rank)
        return f" (pid {proc.pid})" if proc is not None else ""

    def check_health(self) -> None:
        """Raises :class:`WorkerDiedError` once a worker has failed; also polls spawned workers."""
        if self.failure is None:
            self._poll_workers()
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _poll_workers(self) -> None:
        """Record the failure of a spawned worker that has exited."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None and not self._closed:
                died = describe_exit(proc.exitcode)
                self.failure = f"TP worker rank {rank} (pid {proc.pid}) died{died}"

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Send ``plan`` to the workers and run it on every rank; rank 0's sampled tokens.

        Raises:
            WorkerDiedError: a worker has died (before or during the step).
        """
        self.check_health()
        try:
            self.channel.broadcast(to_wire(self.encoder.encode(plan)))
            return self.driver.execute(plan)
        except (ConnectionError, RuntimeError) as e:
            if self._wait_for_failure():
                raise WorkerDiedError(self.failure) from e
            raise

    def _wait_for_failure(self) -> bool:
        """Whether a worker failure is (or, within ``FAILURE_NAMING_WAIT_S``, gets) recorded: a
        peer's death breaks a collective at once, and the watcher names the rank a moment
        later."""
        deadline = time.monotonic() + FAILURE_NAMING_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(FAILURE_POLL_S)
        return self.failure is not None

    def shutdown(self) -> None:
        """Stop every worker (stop message, then terminate spawned stragglers) and leave the
        group."""
        if self._closed:
            return
        self._closed = True
        if self.channel is not None:
            self.channel.close(to_wire(StopMessage()))
        self._stop_workers()
        destroy_distributed()
        torch.set_num_threads(self._threads)

    def _stop_workers(self) -> None:
        """After the stop message: wait for the spawned workers, terminating stragglers."""
        for proc in self.procs.values():
            stop_process(proc, STOP_WAIT_S)
