"""Where data-parallel replicas run: a :class:`ReplicaLauncher` places each replica and starts
:func:`~pyxllm.engine.data_parallel.replica.run_replica` there, returning a
:class:`ReplicaHandle` the API server watches and stops.

- :class:`MultiprocReplicaLauncher` (``--distributed-executor-backend mp``): one process per
  replica on this host, started with multiprocessing's ``spawn``. On the CPU the host's cores
  are divided between the replicas (:func:`plan_placements`): each is pinned to its share of
  the physical cores (hyper-threads of a core stay together) and computes with ``cores / N``
  threads (``OMP_NUM_THREADS``, when set, caps it, as it caps TP ranks); a replica's TP ranks
  split its share again. On an accelerator each replica sees its own ``--tp`` cards.
- :class:`~.ray_launcher.RayReplicaLauncher` (``--distributed-executor-backend ray``) places
  each replica in a placement group of its own on the Ray cluster and runs ``run_replica`` in
  an actor there; the replica connects back to :attr:`ReplicaLauncher.listen_host` (the API
  server's node address) the same way, so nothing else changes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Protocol

from pyxllm.config import EngineConfig
from pyxllm.engine.data_parallel.placement import Placement
from pyxllm.engine.data_parallel.ray_launcher import RayReplicaLauncher
from pyxllm.engine.data_parallel.replica import ReplicaSpec, replica_main
from pyxllm.executor.multiproc import describe_exit, stop_process
from pyxllm.platforms import resolve_platform
from pyxllm.platforms.interface import physical_core_groups

logger = logging.getLogger(__name__)


class ReplicaHandle(Protocol):
    """A started replica, as the API server watches it."""

    def exit_description(self, wait: float = 0.0) -> str | None:
        """``None`` while the replica runs (waiting up to ``wait`` seconds for it to end),
        else how it ended (`` (exit code 1)``, `` (killed by SIGKILL)``)."""
        ...

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the replica to exit (after its stop message),
        then end it by force."""
        ...

    def node(self) -> dict | None:
        """Where the replica runs when that is not this process's host: its Ray node
        (:func:`~pyxllm.distributed.ray_utils.node_info`); ``None`` for a process here (and
        before an actor has started)."""
        ...


class ReplicaLauncher(Protocol):
    """Places and starts replicas.

    Attributes:
        listen_host: the address replicas reach the API server at.
    """

    listen_host: str

    def placements(self, size: int, config: EngineConfig) -> list[Placement]:
        """The placement of each of ``size`` replicas.

        Raises:
            ValueError: the resources cannot hold them (naming the flags).
        """
        ...

    def launch(self, spec: ReplicaSpec) -> ReplicaHandle:
        """Start the replica ``spec`` describes; returns at once."""
        ...


def split_cores(cores: list[tuple[int, ...]], size: int) -> list[tuple[int, ...]] | None:
    """Physical ``cores`` (each a group of CPUs, see
    :func:`~pyxllm.platforms.interface.physical_core_groups`) divided into ``size`` disjoint
    shares of whole cores, as CPU lists (the first replicas get one core more when they do not
    divide evenly); ``None`` when there are fewer cores than replicas (nobody is pinned then)."""
    if len(cores) < size:
        return None
    base, extra = divmod(len(cores), size)
    shares, start = [], 0
    for index in range(size):
        count = base + (1 if index < extra else 0)
        shares.append(tuple(cpu for core in cores[start : start + count] for cpu in core))
        start += count
    return shares


def plan_placements(platform, size: int, tp_size: int) -> list[Placement]:
    """Where each of ``size`` replicas of ``tp_size`` ranks computes on this host (see the
    module doc).

    Raises:
        ValueError: fewer visible cards than ``size * tp_size`` (naming the flags and the
            variable listing the cards).
    """
    if platform.is_accelerator:
        env = platform.visible_devices_env
        listed = os.environ.get(env)
        cards = (
            [c.strip() for c in listed.split(",") if c.strip()]
            if listed is not None
            else [str(i) for i in range(platform.device_module().device_count())]
        )
        if len(cards) < size * tp_size:
            raise ValueError(
                f"--data-parallel-size {size} with --tensor-parallel-size {tp_size} needs "
                f"{size * tp_size} {platform.name} cards, {len(cards)} visible ({env})"
            )
        return [
            Placement(environ=((env, ",".join(cards[i * tp_size : (i + 1) * tp_size])),))
            for i in range(size)
        ]
    cores = physical_core_groups()
    shares = split_cores(cores, size)
    threads = platform.threads_per_rank(size)
    if shares is None:
        logger.warning(
            "--data-parallel-size %d on %d physical cores: the replicas share them, %d thread each",
            size,
            len(cores),
            threads,
        )
        return [Placement(threads) for _ in range(size)]
    return [Placement(min(threads, len(share)), share) for share in shares]


class ProcessHandle:
    """A replica in a spawned process (:class:`ReplicaHandle`)."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int | None:
        """The process id (``None`` before it starts)."""
        return self.process.pid

    def exit_description(self, wait: float = 0.0) -> str | None:
        """See :meth:`ReplicaHandle.exit_description`."""
        if wait > 0:
            self.process.join(timeout=wait)
        code = self.process.exitcode
        return None if code is None else describe_exit(code)

    def stop(self, timeout: float) -> None:
        """See :meth:`ReplicaHandle.stop`."""
        stop_process(self.process, timeout)

    def node(self) -> None:
        """See :meth:`ReplicaHandle.node`: a process on this host."""
        return None


class MultiprocReplicaLauncher:
    """Replicas as processes on this host (see the module doc); ``platform`` is the
    :class:`~pyxllm.platforms.Platform` they compute on."""

    listen_host = "127.0.0.1"

    def __init__(self, platform) -> None:
        self.platform = platform
        self._context = multiprocessing.get_context("spawn")

    def placements(self, size: int, config: EngineConfig) -> list[Placement]:
        """See :func:`plan_placements`."""
        return plan_placements(self.platform, size, config.tensor_parallel_size)

    def launch(self, spec: ReplicaSpec) -> ProcessHandle:
        """Spawn the replica's process (see :func:`~.replica.replica_main`)."""
        # not a daemon: a replica spawns its own TP workers; it exits when the server's
        # connection closes, however the server ends
        process = self._context.Process(
            target=replica_main, args=(spec,), name=f"pyxllm-dp-replica{spec.index}"
        )
        process.start()
        return ProcessHandle(process)


def default_launcher(config: EngineConfig, size: int) -> ReplicaLauncher:
    """The launcher ``--distributed-executor-backend`` names: ``mp``,
    :class:`MultiprocReplicaLauncher`; ``ray``, :class:`~.ray_launcher.RayReplicaLauncher`
    (which joins the Ray cluster at once).

    Raises:
        ValueError: Ray is not installed; DistributedError: its cluster cannot be joined.
    """
    platform = resolve_platform(config.device)
    if config.distributed_executor_backend == "ray":
        return RayReplicaLauncher(platform, config, size)
    return MultiprocReplicaLauncher(platform)
