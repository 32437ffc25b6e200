"""Placing ranks on a Ray cluster: joining it, reserving a placement group, starting actors.

``--distributed-executor-backend ray`` (vLLM's ``vllm/executor/ray_utils.py``): pyxllm joins
the cluster (:func:`connect_ray`), reserves one bundle per rank (:func:`reserve_placement_group`;
bundle 0 on this process's node, which computes rank 0) and starts one actor per bundle
(:func:`start_actors`). Nothing here knows what the actors run: the executor's rank actors
(:mod:`pyxllm.executor.ray_executor`) and the data-parallel replicas' engine actors (a placement
group each, see the engine's ``data_parallel.ray_launcher``) use the same calls.

Ray is an optional dependency (``.venv/bin/pip install 'pyxllm[ray]'``): it is imported only
here, and only when the Ray backend is chosen (:func:`import_ray`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pyxllm.distributed.errors import DistributedError

logger = logging.getLogger(__name__)

RAY_INSTALL = ".venv/bin/pip install 'pyxllm[ray]'"
# Ray's placement strategies (ray.util.placement_group), PACK first: pyxllm's default
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# the label every Ray node carries with its id: pins a bundle to one node
NODE_ID_LABEL = "ray.io/node-id"
# Environment variables a rank actor gets from the process that places it (the nodes' own
# environment is the raylet's, not this process's): pyxllm's settings and the Hugging Face
# cache and credentials the ranks load the model with.
FORWARDED_ENV_PREFIXES = ("PYXLLM_", "HF_")
# while a placement group waits for resources, say once after this many seconds what is missing
# (an autoscaler may still add nodes; the wait itself lasts --dist-init-timeout)
PENDING_REPORT_S = 5.0
PLACEMENT_POLL_S = 0.5


def import_ray(flag: str = "--distributed-executor-backend ray"):
    """The ``ray`` module.

    Raises:
        ValueError: Ray is not installed (naming ``flag``, what asked for Ray, and the install
            command).
    """
    try:
        import ray  # lazy: ray is optional (pyxllm[ray])
    except ImportError:
        raise ValueError(f"{flag}: Ray is not installed here; {RAY_INSTALL}") from None
    return ray


def connect_ray(address: str | None, local_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` (``host:port`` of its head) unless this process has
    already joined one; ``None`` is Ray's own rule: ``RAY_ADDRESS``, else the cluster ``ray
    start`` started on this node, else a new local instance. A local instance gets
    ``local_cpus`` logical CPUs when that is more than this host's cores, so that ranks sharing
    them still fit (as ``mp`` spawns them; a warning says so).

    Returns:
        Whether this call joined (the caller then leaves with :func:`disconnect_ray`).
    Raises:
        DistributedError: the cluster cannot be reached (naming the address).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    cores = os.cpu_count() or 1
    cpus = local_cpus if local_cpus and local_cpus > cores else None
    where = address or os.environ.get("RAY_ADDRESS") or "this node's or a new local cluster"
    try:
        try:
            ray.init(address=address, num_cpus=cpus, logging_level=logging.WARNING)
        except ValueError:  # an existing cluster: its CPUs are its nodes' to say
            if cpus is None:
                raise
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            if cpus is not None:  # accepted: a local instance was started
                logger.warning(
                    "started a local Ray instance with %d logical CPUs on %d cores: the ranks "
                    "take turns on the cores (see docs/parallelism.md)",
                    cpus,
                    cores,
                )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"--ray-address: could not join the Ray cluster at {where} ({exc}); start it with "
            "`ray start --head` (or check the address); a cluster with token authentication on "
            "also needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or "
            "~/.ray/auth_token) in this process's environment"
        ) from None
    return True


def disconnect_ray() -> None:
    """Leave the Ray cluster (a no-op when not joined)."""
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (this process's) that rank actors get too
    (:data:`FORWARDED_ENV_PREFIXES`)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def node_info() -> dict[str, Any]:
    """Where the calling Ray worker (or driver) runs: ``node_id``, ``node_ip`` (the address
    other nodes reach it at), ``hostname``, ``pid``, and ``accelerators`` (Ray's accelerator ids
    assigned to it, by resource name)."""
    ray = import_ray()
    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "accelerators": {k: list(v) for k, v in context.get_accelerator_ids().items() if v},
    }


def describe_node(info: Mapping[str, Any]) -> str:
    """``node 3f2a91c0 at 10.0.0.2`` (the node id's first digits, the node's address), from a
    :func:`node_info` result."""
    return f"node {info['node_id'][:8]} at {info['node_ip']}"


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _fits(bundle: Mapping[str, float], resources: Mapping[str, float], times: int = 1) -> bool:
    return all(resources.get(k, 0.0) >= v * times for k, v in bundle.items())


def describe_shortfall(
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    nodes: Mapping[str, Mapping[str, float]],
    available: Mapping[str, float],
    first_node: str | None = None,
) -> str:
    """What keeps ``bundles`` (all alike) from being placed with ``strategy``, in words naming
    the resources, e.g. ``"CPU: the bundles need 3, 2 of 4 are free"``.

    Args:
        nodes: each alive node's id -> its total resources.
        available: the resources free in the whole cluster now.
        first_node: the node bundle 0 is pinned to (this process's), if any.
    """
    bundle, count = bundles[0], len(bundles)
    reasons = []
    for key in sorted(bundle):
        need, total = bundle[key] * count, sum(n.get(key, 0.0) for n in nodes.values())
        if total < bundle[key]:
            reasons.append(f"{key}: no node has any (a bundle needs {bundle[key]:g})")
        elif available.get(key, 0.0) < need:
            reasons.append(
                f"{key}: the bundles need {need:g}, {available.get(key, 0.0):g} of {total:g} "
                "are free"
            )
    fitting = sum(_fits(bundle, n) for n in nodes.values())
    if strategy == "STRICT_SPREAD" and fitting < count:
        reasons.append(
            f"STRICT_SPREAD needs {count} nodes with {_fmt(bundle)} each, the cluster has {fitting}"
        )
    if strategy == "STRICT_PACK" and not any(_fits(bundle, n, count) for n in nodes.values()):
        reasons.append(f"STRICT_PACK needs one node with {count} x {_fmt(bundle)}, none has it")
    if first_node is not None and not _fits(bundle, nodes.get(first_node, {})):
        reasons.append(f"this node ({first_node[:8]}), where rank 0 runs, has no {_fmt(bundle)}")
    if not reasons:
        reasons.append(
            "the resources are held by other placement groups or tasks (see `ray status`)"
        )
    return "; ".join(reasons)


def _cluster_resources(ray) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    nodes = {n["NodeID"]: dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")}
    return nodes, dict(ray.available_resources())


def reserve_placement_group(
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    timeout_s: float,
    first_node: str | None = None,
):
    """Reserve a placement group of ``bundles`` (one per rank) placed with ``strategy``, bundle
    0 on node ``first_node`` (a node id) when given; wait until Ray has placed it.

    Returns:
        The ``ray.util.placement_group.PlacementGroup``; free it with
        :func:`remove_placement_group`.
    Raises:
        DistributedError: not placed within ``timeout_s`` seconds (naming the missing
            resources, see :func:`describe_shortfall`); the request is withdrawn first.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group  # lazy: ray is optional

    selectors = [{NODE_ID_LABEL: first_node} if first_node else {}] + [{}] * (len(bundles) - 1)
    pg = placement_group(
        [dict(b) for b in bundles], strategy=strategy, bundle_label_selector=selectors
    )
    started, reported = time.monotonic(), False
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_POLL_S)
        if ready:
            return pg
        waited = time.monotonic() - started
        if waited >= timeout_s or (not reported and waited >= PENDING_REPORT_S):
            shortfall = describe_shortfall(bundles, strategy, *_cluster_resources(ray), first_node)
            what = f"{len(bundles)} bundles of {_fmt(bundles[0])} ({strategy})"
            if waited >= timeout_s:
                remove_placement_group(pg)
                raise DistributedError(
                    f"Ray could not place {what} within --dist-init-timeout {timeout_s:g} s: "
                    f"{shortfall}"
                )
            logger.warning("waiting for Ray to place %s: %s", what, shortfall)
            reported = True


def remove_placement_group(pg) -> None:
    """Free a placement group's resources (its actors are killed with it)."""
    from ray.util.placement_group import remove_placement_group as remove  # ray is optional

    remove(pg)


def start_actors(
    actor_cls: type,
    pg,
    bundles: Sequence[Mapping[str, float]],
    names: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> list:
    """Start one ``actor_cls`` actor in each bundle of ``pg`` (``bundles`` as reserved), taking
    the bundle's resources: a ``GPU`` as ``num_gpus``, ``CPU`` as ``num_cpus``, others by name.

    Args:
        names: the actors' names (``ray.get_actor`` finds them; ``ray list actors`` shows them).
        env: environment variables the actors start with (default: :func:`forwarded_env`).
    Returns:
        The actor handles, in bundle order (started asynchronously: a call on one waits for it).
    """
    ray = import_ray()
    # lazy: ray is optional
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_cls = ray.remote(actor_cls)
    env = forwarded_env() if env is None else dict(env)
    actors = []
    for index, bundle in enumerate(bundles):
        resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        options = dict(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            resources=resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
            runtime_env={"env_vars": env} if env else None,
        )
        if names is not None:
            options["name"] = names[index]
        actors.append(remote_cls.options(**options).remote())
    return actors


def actor_error_summary(exc: BaseException) -> str:
    """One line for a Ray error: for a task that raised, what it raised; for an actor's death,
    Ray's first line and its reason (``ActorDiedError: The actor died unexpectedly before
    finishing this task. The actor is dead because it was killed by `ray.kill`.``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):  # a RayTaskError: the exception of the task itself
        exc = cause
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    # an actor's death continues with indented "key: value" lines, then the reason
    reason = next((line.strip() for line in lines[1:] if not line[0].isspace()), "")
    return f"{type(exc).__name__}: {' '.join(filter(None, [lines[0].strip(), reason]))[:300]}"
