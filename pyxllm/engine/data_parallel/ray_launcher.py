"""Data-parallel replicas on a Ray cluster (``--data-parallel-size N
--distributed-executor-backend ray``): :class:`RayReplicaLauncher` places each replica in a
placement group of its own and runs :func:`~.replica.run_replica` in an :class:`EngineActor`
there; the replica connects back to the API server as a local one does.

Placement follows vLLM's data parallelism on Ray: one placement group per replica and no
constraint between the groups. A group is ``--tp`` bundles
(:func:`~pyxllm.executor.ray_executor.rank_bundle`: one accelerator per rank, or on the CPU the
cores one rank of ``--tp`` would take alone on the API server's host, so that on nodes like it
a replica fills a node unless ``OMP_NUM_THREADS`` makes it smaller), placed with
``--ray-placement-strategy`` (``PACK`` by default; vLLM always packs a replica on one node).
The strategy applies within each replica only: under ``STRICT_SPREAD`` a replica's ranks are on
distinct nodes, but two replicas may share nodes that have room for both, as vLLM's do. Ray puts
each group where it fits; nothing pins a replica to the API server's node, since every replica
computes its own rank 0 and the server only routes. The groups are reserved one after the other
before any replica starts, all within ``--dist-init-timeout``; one that cannot be placed fails
the start-up naming the replica and the missing resources, and frees the groups already
reserved.

In its group the replica's :class:`EngineActor` sits in bundle 0. With ``--tp 1`` it holds the
bundle and computes there; with more ranks it asks for nothing itself: it builds its engine with
the ``ray`` executor, which puts its ranks in that same group, rank 0's actor holding bundle 0
while this actor computes rank 0 (see :mod:`pyxllm.executor.ray_executor`). Killing the actor
ends its rank actors too (Ray ends the actors an actor owns with it); the API server owns the
groups and frees them when it stops its replicas, or when it exits (Ray frees what a job
holds).
"""

from __future__ import annotations

import logging
import time
import uuid

from pyxllm.config import EngineConfig
from pyxllm.distributed import ray_utils
from pyxllm.distributed.errors import DistributedError
from pyxllm.engine.data_parallel.placement import Placement
from pyxllm.engine.data_parallel.replica import ReplicaSpec, run_replica, tag_logs
from pyxllm.executor.ray_executor import rank_bundle

logger = logging.getLogger(__name__)


class EngineActor:
    """A data-parallel replica as a Ray actor: says where it runs, then is the replica."""

    def node_info(self) -> dict:
        """:func:`~pyxllm.distributed.ray_utils.node_info` of this actor."""
        return ray_utils.node_info()

    def run(self, spec: ReplicaSpec) -> int:
        """Be replica ``spec.index`` (:func:`~.replica.run_replica`, its log lines tagged
        ``replica i``); returns its exit status."""
        tag_logs(spec.index)
        return run_replica(spec)


class RayReplicaHandle:
    """A replica in an :class:`EngineActor` (:class:`~.launcher.ReplicaHandle`).

    Attributes:
        actor: the actor's handle (named ``pyxllm-dp-replica<i>-<tag>``).
        placement_group: the replica's group, freed by :meth:`stop`.
    """

    def __init__(self, actor, placement_group, info_ref, run_ref) -> None:
        self.actor, self.placement_group = actor, placement_group
        self._info_ref, self._run_ref = info_ref, run_ref
        self._info: dict | None = None

    def node(self) -> dict | None:
        """The actor's :func:`~pyxllm.distributed.ray_utils.node_info` (``None`` until it has
        started, or if it died first)."""
        if self._info is None:
            ray = ray_utils.import_ray()
            try:
                ready, _ = ray.wait([self._info_ref], timeout=0)
                self._info = ray.get(ready[0]) if ready else None
            except Exception:  # noqa: BLE001 - it died before saying: there is no node to name
                return None
        return self._info

    def exit_description(self, wait: float = 0.0) -> str | None:
        """See :class:`~.launcher.ReplicaHandle`: `` (exit status 1)``, or what Ray says of the
        actor's end (`` (ActorDiedError: ... killed by `ray.kill`.)``)."""
        ray = ray_utils.import_ray()
        try:
            ready, _ = ray.wait([self._run_ref], timeout=wait)
            if not ready:
                return None
            how = f"exit status {ray.get(self._run_ref)}"
        except Exception as e:  # noqa: BLE001 - the error is the answer (Ray's own, too)
            how = ray_utils.actor_error_summary(e)
        return f" ({how})"

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the replica to return, then kill its actor (its
        rank actors go with it) and free its placement group."""
        ray = ray_utils.import_ray()
        try:
            ray.wait([self._run_ref], timeout=timeout)
            ray.kill(self.actor)
            ray_utils.remove_placement_group(self.placement_group)
        except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
            logger.warning("stopping a replica's Ray actor: %s", ray_utils.actor_error_summary(e))


class RayReplicaLauncher:
    """Replicas as Ray actors, each in a placement group of its own (see the module doc).

    Joins the cluster at once (``config.ray_address``, else ``RAY_ADDRESS``, else the cluster
    ``ray start`` started on this node, else a new local one, big enough for ``size`` replicas:
    :func:`~pyxllm.distributed.ray_utils.connect_ray`), to know the address replicas reach the
    API server at.

    Args:
        platform: the :class:`~pyxllm.platforms.Platform` the ranks compute on.
        config: the replicas' configuration (``--tp``, the Ray flags).
        size: ``--data-parallel-size``.

    Attributes:
        listen_host: this node's address on the cluster (Ray's node address).
        bundles: one replica's bundles, one per rank.
        strategy: how each replica's bundles are placed (``--ray-placement-strategy``).

    Raises:
        ValueError: Ray is not installed (naming the install command).
        DistributedError: the cluster cannot be joined (naming the address).
    """

    def __init__(self, platform, config: EngineConfig, size: int) -> None:
        tp = config.tensor_parallel_size
        self.platform = platform
        self.strategy = config.ray_placement_strategy or "PACK"
        self.bundles = [rank_bundle(platform, tp, self.strategy)] * tp
        cpus = int(size * sum(bundle.get("CPU", 0) for bundle in self.bundles))
        ray_utils.connect_ray(config.ray_address, local_cpus=cpus)
        self.listen_host = ray_utils.import_ray().util.get_node_ip_address()
        self._groups: list = []
        self._tag = uuid.uuid4().hex[:8]

    def placements(self, size: int, config: EngineConfig) -> list[Placement]:
        """Reserve each replica's placement group, within ``--dist-init-timeout`` in all;
        each replica computes with its bundle's cores as torch threads (on an accelerator,
        Ray's choice of cards).

        Raises:
            DistributedError: a group could not be placed in time (naming the replica and the
                missing resources); the groups reserved before it are freed.
        """
        deadline = time.monotonic() + config.dist_init_timeout
        groups: list = []
        try:
            for index in range(size):
                left = max(0.0, deadline - time.monotonic())
                try:
                    group = ray_utils.reserve_placement_group(self.bundles, self.strategy, left)
                except DistributedError as e:
                    raise DistributedError(
                        f"--data-parallel-size {size}: data-parallel replica {index} "
                        f"({index} of {size} placed): {e}"
                    ) from None
                groups.append(group)
        except BaseException:
            for group in groups:
                ray_utils.remove_placement_group(group)
            raise
        self._groups = groups
        threads = None if self.platform.is_accelerator else int(self.bundles[0]["CPU"])
        return [Placement(threads) for _ in range(size)]

    def launch(self, spec: ReplicaSpec) -> RayReplicaHandle:
        """Start replica ``spec.index``'s :class:`EngineActor` in bundle 0 of its group (with
        the bundle's resources at ``--tp 1``, none beyond at more ranks, see the module doc) and
        its :meth:`EngineActor.run`; returns at once."""
        group = self._groups[spec.index]
        alone = spec.config.tensor_parallel_size == 1
        resources = [self.bundles[0] if alone else {"CPU": 0.0}]
        name = f"pyxllm-dp-replica{spec.index}-{self._tag}"
        actor = ray_utils.start_actors(EngineActor, group, resources, [name])[0]
        # an actor runs its calls in order: node_info answers before run starts
        return RayReplicaHandle(actor, group, actor.node_info.remote(), actor.run.remote(spec))
