"""Tensor parallelism on a Ray cluster (``--distributed-executor-backend ray``; vLLM's
``RayDistributedExecutor``): Ray places the ranks, pyxllm's own channel and collectives run them.

Start-up, within ``--dist-init-timeout``:

1. join the cluster (``--ray-address``, else ``RAY_ADDRESS``, else the cluster ``ray start``
   started on this node, else a new local one; :func:`~pyxllm.distributed.ray_utils.connect_ray`);
2. reserve a placement group of one bundle per rank (one accelerator, or on the CPU
   :meth:`~pyxllm.platforms.interface.Platform.threads_per_rank` cores), placed with
   ``--ray-placement-strategy`` (``PACK`` by default), bundle 0 on this node: this process
   computes rank 0, as with ``mp``. A process that already runs in a placement group (an actor
   placed by someone else, e.g. a data-parallel replica) uses that group instead, ``--tp``
   bundles (its owner sizes them, as :func:`rank_bundle` does on the owner's host): start it in
   bundle 0 asking for no resources of its own (``start_actors(cls, group, [{"CPU": 0}])``),
   since rank 0's actor holds them;
3. start one :class:`RayWorker` actor per bundle; each says where it runs
   (:func:`~pyxllm.distributed.ray_utils.node_info`). Rank 0's actor only holds its bundle (and
   names the card this process takes); the others run :func:`~pyxllm.executor.worker.run_worker`
   with the master address made of rank 0's actor's node address and a free port, so nobody
   types one.

From there on it is :class:`~pyxllm.executor.multiproc.MultiprocExecutor`: each step's plan
goes down the control channel, the collectives run on torch.distributed. Faults take the same
path too: a rank whose control connection closes, or whose actor Ray reports dead (its process
killed, its node lost), sets :attr:`failure`, naming the rank, its pid and its node.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from pyxllm.config import EngineConfig
from pyxllm.distributed import ray_utils
from pyxllm.distributed.errors import DistributedError
from pyxllm.executor.multiproc import (
    EXIT_STATUS_WAIT_S,
    STOP_WAIT_S,
    MultiprocExecutor,
    free_local_port,
)
from pyxllm.executor.worker import run_worker

logger = logging.getLogger(__name__)

# the strategies that may put several ranks on one node, whose cores they then share
PACKING_STRATEGIES = ("PACK", "STRICT_PACK")
# the watcher asks Ray this often whether a rank's actor has ended
WATCH_POLL_S = 0.5


class RayWorker:
    """A TP rank as a Ray actor: says where it runs, then (ranks > 0) runs the worker loop."""

    def node_info(self) -> dict:
        """:func:`~pyxllm.distributed.ray_utils.node_info` of this actor."""
        return ray_utils.node_info()

    def run(
        self,
        config: EngineConfig,
        rank: int,
        world_size: int,
        master_addr: str,
        local_rank: int,
        num_threads: int | None,
    ) -> int:
        """Be TP rank ``rank`` until rank 0 stops it (:func:`~pyxllm.executor.worker.run_worker`);
        returns its exit status, or raises what it raised."""
        logging.basicConfig(
            level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s"
        )
        return run_worker(
            config, rank, world_size, master_addr, local_rank, num_threads=num_threads
        )


def rank_bundle(platform, world_size: int, strategy: str) -> dict[str, float]:
    """The resources one rank reserves: one accelerator (``platform.ray_resource``), or on the
    CPU its share of this host's cores when the ranks may share a node (``PACK``), else the
    host's cores (as many as this process may use)."""
    if platform.is_accelerator:
        return {platform.ray_resource: 1.0}
    sharing = world_size if strategy in PACKING_STRATEGIES else 1
    return {"CPU": float(platform.threads_per_rank(sharing))}


class RayDistributedExecutor(MultiprocExecutor):
    """Rank 0's executor with ranks placed by Ray (see the module's docstring).

    Attributes:
        placement: rank -> where its actor runs (:func:`~pyxllm.distributed.ray_utils.node_info`:
            ``node_id``, ``node_ip``, ``hostname``, ``pid``, ``accelerators``).
        actors: the rank actors, rank 0's first.
        placement_group: the group the ranks are placed in, bundle ``r`` rank ``r``'s: reserved
            here (and freed at :meth:`shutdown`), or the one this process was placed in.

    Raises:
        ValueError: Ray is not installed, or the model does not split.
        DistributedError: the cluster cannot be joined, the placement group cannot be placed
            (naming the missing resources), or a rank did not start, all within
            ``--dist-init-timeout``.
    """

    join_hint = (
        "the Ray actors of the other ranks are slow or stuck before joining; their output "
        "is in this log (lines starting with (RayWorker pid=...)) and in `ray logs`"
    )

    def _start_workers(self, config: EngineConfig, platform) -> tuple[str, int, int]:
        self.actors, self.placement, self._runs = [], {}, {}
        self.placement_group = self._watcher = None
        self._owns_ray = self._owns_pg = False
        ray = ray_utils.import_ray()
        deadline = time.monotonic() + config.dist_init_timeout
        strategy = config.ray_placement_strategy or "PACK"
        bundles = [rank_bundle(platform, self.world_size, strategy)] * self.world_size
        cpus = int(sum(bundle.get("CPU", 0) for bundle in bundles))
        self._owns_ray = ray_utils.connect_ray(config.ray_address, local_cpus=cpus)
        here = ray.get_runtime_context().get_node_id()
        self.placement_group = ray.util.get_current_placement_group()
        self._owns_pg = self.placement_group is None
        if self._owns_pg:
            self.placement_group = ray_utils.reserve_placement_group(
                bundles, strategy, config.dist_init_timeout, first_node=here
            )
        else:  # its owner sized the bundles (on its own host, which may not be this one)
            bundles = self._group_bundles()
        tag = uuid.uuid4().hex[:8]
        names = [f"pyxllm-tp-rank{rank}-{tag}" for rank in range(self.world_size)]
        self.actors = ray_utils.start_actors(RayWorker, self.placement_group, bundles, names)
        self._await_placement(ray, deadline)
        if self.placement[0]["node_id"] != here:
            raise DistributedError(
                "--distributed-executor-backend ray: bundle 0 of the placement group is on "
                f"{ray_utils.describe_node(self.placement[0])}, but rank 0 computes in this "
                "process, so it must be on this node"
            )
        master = f"{self.placement[0]['node_ip']}:{free_local_port()}"
        threads = int(bundles[0].get("CPU", 0)) or None
        for rank in range(1, self.world_size):
            self._runs[rank] = self.actors[rank].run.remote(
                config, rank, self.world_size, master, self._local_rank(rank, platform), threads
            )
        self._watcher = threading.Thread(target=self._watch, name="pyxllm-ray-watch", daemon=True)
        self._watcher.start()
        nodes = len({info["node_id"] for info in self.placement.values()})
        self.placed = f"Ray actors on {nodes} node{'s' if nodes > 1 else ''}, {strategy}"
        return master, threads or platform.threads_per_rank(1), self._local_rank(0, platform)

    def _group_bundles(self) -> list[dict[str, float]]:
        """The bundles of the placement group this process was placed in, one per rank.

        Raises:
            DistributedError: the group does not have one bundle per rank.
        """
        bundles = [dict(bundle) for bundle in self.placement_group.bundle_specs]
        if len(bundles) != self.world_size:
            raise DistributedError(
                f"--tensor-parallel-size {self.world_size}: this process runs in a Ray "
                f"placement group of {len(bundles)} bundles, not one per rank"
            )
        return bundles

    def _await_placement(self, ray, deadline: float) -> None:
        """Fill :attr:`placement` from every actor's ``node_info``, by ``deadline``.

        Raises:
            DistributedError: an actor did not start in time, or died starting (naming it).
        """
        refs = {actor.node_info.remote(): rank for rank, actor in enumerate(self.actors)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(refs[ref] for ref in pending)
                raise DistributedError(
                    f"Ray actors of TP ranks {missing} did not start within --dist-init-timeout"
                )
            for ref in ready:
                try:
                    self.placement[refs[ref]] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any Ray error: name the rank
                    raise DistributedError(
                        f"the Ray actor of TP rank {refs[ref]} could not start: "
                        f"{ray_utils.actor_error_summary(e)}"
                    ) from None
        self.placement = dict(sorted(self.placement.items()))

    def _local_rank(self, rank: int, platform) -> int:
        """The card index rank ``rank`` takes on its node: 0 when Ray made only its own card
        visible to the actor; rank 0 (this process sees every card) the id Ray gave its actor;
        without Ray's card ids (a custom resource), the rank's index among its node's ranks."""
        info = self.placement[rank]
        ids = info["accelerators"].get(platform.ray_resource)
        if ids and platform.is_accelerator:
            return int(ids[0]) if rank == 0 else 0
        return sum(self.placement[r]["node_id"] == info["node_id"] for r in range(rank))

    def _watch(self) -> None:
        """Record the first rank whose actor's ``run`` ends before :meth:`shutdown` (its process
        died, its node was lost, or the worker loop raised)."""
        ray = ray_utils.import_ray()
        pending = {ref: rank for rank, ref in self._runs.items()}
        while pending and not self._closed:
            try:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_POLL_S)
            except Exception:  # noqa: BLE001 - Ray itself went away: the shutdown's to handle
                return
            for ref in ready:
                rank = pending.pop(ref)
                if not self._closed:
                    self._on_worker_failure(rank, None)

    def _exit_detail(self, rank: int) -> str:
        """What Ray says of rank ``rank``'s end, e.g. `` (ActorDiedError: ...)``, once it knows
        (waiting up to ``EXIT_STATUS_WAIT_S``)."""
        ray = ray_utils.import_ray()
        ref = self._runs.get(rank)
        if ref is None:
            return ""
        try:
            ready, _ = ray.wait([ref], timeout=EXIT_STATUS_WAIT_S)
            if not ready:
                return ""
            return f" (exit status {ray.get(ref)})"
        except Exception as e:  # noqa: BLE001 - the error is the answer
            return f" ({ray_utils.actor_error_summary(e)})"

    def _whereabouts(self, rank: int) -> str:
        info = self.placement.get(rank)
        if info is None:
            return ""
        return f" (Ray actor, pid {info['pid']} on {ray_utils.describe_node(info)})"

    def _poll_workers(self) -> None:
        """Nothing to poll: :meth:`_watch` hears from Ray as soon as an actor ends."""

    def _stop_workers(self) -> None:
        """After the stop message: wait for the workers' loops to end, then kill the actors,
        free the placement group (if this executor reserved it) and leave the cluster (if this
        executor joined it)."""
        try:
            ray = ray_utils.import_ray()
            if not ray.is_initialized():
                return
            if self._runs:
                ray.wait(
                    list(self._runs.values()), num_returns=len(self._runs), timeout=STOP_WAIT_S
                )
            for actor in self.actors:
                ray.kill(actor)
            if self.placement_group is not None and self._owns_pg:
                ray_utils.remove_placement_group(self.placement_group)
        except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
            logger.warning("stopping the Ray actors: %s", ray_utils.actor_error_summary(e))
        finally:
            if self._watcher is not None:
                self._watcher.join(timeout=WATCH_POLL_S * 2)
            if self._owns_ray:
                ray_utils.disconnect_ray()
