"""Tensor parallelism placed by Ray (``--distributed-executor-backend ray``), on a real Ray
cluster this module starts on this machine: a head (``ray start --head``) and a second node
(``ray start --address``), each with its own CPUs and a custom resource, in a temp dir and on
ports of their own, stopped at the end (:class:`tests.utils.RayCluster`). Usage stats are off,
there is no dashboard, the object stores are 100 MB.

- SmolLM2 at ``--tp 3`` (PACK) gives tp=1's greedy tokens; a tiny Qwen3 at ``--tp 2`` with
  STRICT_SPREAD puts one rank on each node and gives tp=1's tokens (the checks of
  tests/executor/test_tensor_parallel.py's ``greedy_tokens``);
- an engine in an actor placed in a group's bundle 0 (as data-parallel replicas are to be
  placed) puts its ranks in that group;
- a placement group that cannot be placed fails within ``--dist-init-timeout``, naming what is
  missing, and frees what it held; so do data-parallel replicas that do not all fit;
- ``-dp 2 --tp 2`` puts one replica on each node, gives one engine's greedy completions, and
  serves on (``/health`` degraded) when one replica's actor is killed;
- a server whose rank-1 actor is killed mid-request fails that request, answers 503 on
  ``/health`` and exits 1 naming the rank and its node;
- without Ray installed the flag fails with the install command; the flags' errors name them;
  a cluster that cannot be joined is named, with what token authentication needs.

The machine has 2 cores shared with other jobs: one cluster for the module, prompts short, every
rank one torch thread (so one CPU per bundle).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.distributed.errors import DistributedError
from pyxllm.distributed.ray_utils import describe_shortfall
from tests.executor.test_tensor_parallel import ENGINE, PARAMS, PROMPTS, greedy_tokens
from tests.model_fixtures import build_checkpoint
from tests.utils import RayCluster, RemoteServer, kill_mid_stream

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("one_thread")

# the head and the second node: 2 logical CPUs each, and a resource naming the node
HEAD, SECOND = {"pyxllm_test_head": 1.0}, {"pyxllm_test_second": 1.0}


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(num_cpus=2, resources=HEAD) as nodes:
        nodes.add_node(2, SECOND)
        yield nodes


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, hf_gguf_tokenizer):
    return str(
        build_checkpoint("qwen3", tmp_path_factory.mktemp("ray_qwen3"), hf_gguf_tokenizer)[0]
    )


@pytest.fixture(scope="module")
def tiny_tp1(tiny_qwen3):
    """The tiny Qwen3's greedy tokens at tp=1 (``greedy_tokens``' prompts)."""
    return greedy_tokens(tiny_qwen3, 1)[0]


def _ray(cluster: RayCluster, **engine) -> dict:
    return dict(distributed_executor_backend="ray", ray_address=cluster.address, **engine)


def test_without_ray_the_flag_names_the_install_command(monkeypatch, capsys):
    from pyxllm.cli.main import parse_args

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(SystemExit):
        parse_args(["serve", "--tp", "3", "--distributed-executor-backend", "ray"])
    assert ".venv/bin/pip install 'pyxllm[ray]'" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"Ray is not installed here; .venv/bin/pip install 'pyxllm\[ray\]'"
    ):
        LLM(tensor_parallel_size=3, distributed_executor_backend="ray")


def test_ray_flags_and_their_errors(capsys):
    from pyxllm.cli.main import parse_args

    _, config = parse_args(
        ["serve", "--tp", "2", "--distributed_executor_backend", "ray"]
        + ["--ray-address", "10.0.0.1:6379", "--ray-placement-strategy", "STRICT_SPREAD"]
    )
    assert (config.distributed_executor_backend, config.ray_address) == ("ray", "10.0.0.1:6379")
    assert config.ray_placement_strategy == "STRICT_SPREAD"
    assert parse_args(["serve"])[1].distributed_executor_backend == "mp"
    for argv, named in (
        (["--ray-address", "h:1"], "--ray-address: applies to --distributed-executor-backend ray"),
        (["--ray-placement-strategy", "PACK"], "--ray-placement-strategy: applies"),
        (["--distributed-executor-backend", "ray", "--nnodes", "2"], "--nnodes: not with"),
        (["--distributed-executor-backend", "ray", "--master-addr", "h:1"], "--master-addr:"),
        (["--distributed-executor-backend", "slurm"], "--distributed-executor-backend"),
        (["--distributed-executor-backend", "ray", "--ray-placement-strategy", "ANY"], "PACK"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["serve", *argv])
        assert named in capsys.readouterr().err, argv


def test_a_cluster_that_cannot_be_joined_names_the_address_and_the_token(monkeypatch):
    """Ray's own error says only that it failed to connect (a missing token shows only in its
    log lines): the message names the address, how to start a head and what token
    authentication needs (no cluster started: ``ray.init`` fails as Ray's does)."""
    from pyxllm.distributed.ray_utils import connect_ray

    def refuse(address=None, **_):
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(DistributedError) as error:
        connect_ray("10.0.0.1:6379")
    message = str(error.value)
    assert "could not join the Ray cluster at 10.0.0.1:6379 (Failed to connect" in message
    assert "`ray start --head`" in message
    assert "RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or ~/.ray/auth_token)" in message


def test_the_shortfall_names_the_missing_resources():
    """What the start-up error says, for each way a group can fail to fit (no Ray needed)."""
    cpu, nodes = {"CPU": 2.0}, {"a" * 20: {"CPU": 4.0}, "b" * 20: {"CPU": 4.0}}
    assert describe_shortfall([cpu] * 3, "PACK", nodes, {"CPU": 3.0}) == (
        "CPU: the bundles need 6, 3 of 8 are free"
    )
    assert describe_shortfall([cpu] * 3, "STRICT_SPREAD", nodes, {"CPU": 8.0}) == (
        "STRICT_SPREAD needs 3 nodes with {CPU: 2} each, the cluster has 2"
    )
    assert describe_shortfall([cpu] * 3, "STRICT_PACK", nodes, {"CPU": 8.0}) == (
        "STRICT_PACK needs one node with 3 x {CPU: 2}, none has it"
    )
    gpu = describe_shortfall([{"GPU": 1.0}] * 2, "PACK", nodes, {"CPU": 8.0}, "a" * 20)
    assert gpu == (
        "GPU: no node has any (a bundle needs 1); this node (aaaaaaaa), where rank 0 runs, "
        "has no {GPU: 1}"
    )
    assert "held by other placement groups" in describe_shortfall([cpu], "PACK", nodes, cpu)


def test_smollm2_tp3_on_ray_greedy_equals_tp1(cluster):
    ref, _ = greedy_tokens(None, 1)
    got, _ = greedy_tokens(None, 3, **_ray(cluster))
    assert got == ref
    assert all(len(set(t)) >= 3 for t in ref)  # real continuations, not one repeated token


def test_tiny_qwen3_tp2_one_rank_per_node_equals_tp1(cluster, tiny_qwen3, tiny_tp1):
    """STRICT_SPREAD on the two nodes: rank 0 on the node this process joined, rank 1 on the
    other (``greedy_tokens`` checks that their nodes differ)."""
    got, _ = greedy_tokens(tiny_qwen3, 2, **_ray(cluster, ray_placement_strategy="STRICT_SPREAD"))
    assert got == tiny_tp1
    assert len({tuple(t) for t in tiny_tp1}) == len(tiny_tp1)


def test_an_engine_placed_in_a_group_puts_its_ranks_in_that_group(cluster, tiny_qwen3, tiny_tp1):
    """How an engine replica is placed on Ray: an actor started in bundle 0 of a group of
    ``--tp`` bundles (taking no CPU itself: rank 0's actor holds the bundle) builds its engine
    with its ranks in that group, leaves the group to its owner, and gives tp=1's tokens."""

    from pyxllm.distributed import ray_utils

    class Replica:  # defined here: Ray sends it by value to a worker that cannot import tests
        def generate(self, model, prompts, params, engine):
            torch.set_num_threads(1)
            llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **engine)
            try:
                executor, group = llm.llm_engine.executor, ray.util.get_current_placement_group()
                assert executor.placement_group.id == group.id
                outs = llm.generate(prompts, params)
                return [list(o.outputs[0].token_ids) for o in outs]
            finally:
                llm.llm_engine.shutdown()

    bundles = [{"CPU": 1.0}] * 2
    here = ray.get_runtime_context().get_node_id()
    group = ray_utils.reserve_placement_group(bundles, "PACK", 30, first_node=here)
    try:
        replica = ray_utils.start_actors(Replica, group, [{"CPU": 0.0}])[0]
        tokens = ray.get(replica.generate.remote(tiny_qwen3, PROMPTS, PARAMS, ENGINE), timeout=120)
        assert tokens == tiny_tp1
        assert _free_cpus(2.0) == 2.0  # the group's 2 are still held
        ray.kill(replica)
    finally:
        ray_utils.remove_placement_group(group)


def test_an_unplaceable_group_fails_within_the_timeout_naming_the_resources(cluster):
    started = time.monotonic()
    with pytest.raises(DistributedError) as e:
        LLM(
            tensor_parallel_size=3,
            **ENGINE,
            **_ray(cluster, ray_placement_strategy="STRICT_SPREAD", dist_init_timeout=3),
        )
    elapsed = time.monotonic() - started
    assert "Ray could not place 3 bundles of {CPU: 1} (STRICT_SPREAD) within" in str(e.value)
    assert "STRICT_SPREAD needs 3 nodes with {CPU: 1} each, the cluster has 2" in str(e.value)
    assert 3 <= elapsed < 15, elapsed
    assert _free_cpus(4.0) == 4.0  # the withdrawn group's CPUs are free again


def _free_cpus(expected: float, timeout: float = 10.0) -> float:
    """The cluster's free CPUs once they are ``expected`` (Ray's count lags a little), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU") != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU")


def _named_actor(prefix: str):
    """The handle of the one live actor whose name starts with ``prefix`` (any namespace), e.g.
    ``pyxllm-tp-rank1-`` (a TP rank) or ``pyxllm-dp-replica0-`` (a data-parallel replica)."""
    found = [
        ray.get_actor(entry["name"], namespace=entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(prefix)
    ]
    assert len(found) == 1, (prefix, found)
    return found[0]


def test_unplaceable_replicas_fail_within_the_timeout_naming_the_resources(cluster):
    """``-dp 3 --tp 2`` needs 6 CPUs of the cluster's 4: the third replica's group fails the
    start-up in time, naming it and the missing CPUs, and the two groups placed are freed."""
    from pyxllm.config import EngineConfig
    from pyxllm.engine.data_parallel.ray_launcher import RayReplicaLauncher
    from pyxllm.platforms import resolve_platform

    config = EngineConfig(tensor_parallel_size=2, **_ray(cluster, dist_init_timeout=3))
    launcher = RayReplicaLauncher(resolve_platform("cpu"), config, 3)
    started = time.monotonic()
    with pytest.raises(DistributedError) as e:
        launcher.placements(3, config)
    elapsed = time.monotonic() - started
    assert str(e.value).startswith(
        "--data-parallel-size 3: data-parallel replica 2 (2 of 3 placed): Ray could not place 2 "
        "bundles of {CPU: 1} (PACK) within --dist-init-timeout"
    ), e.value
    assert "CPU: the bundles need 2, 0 of 4 are free" in str(e.value)
    assert 2 <= elapsed < 15, elapsed
    assert _free_cpus(4.0) == 4.0


def test_data_parallel_replicas_on_the_cluster(cluster, tiny_qwen3):
    """``-dp 2 --tp 2 --distributed-executor-backend ray``: each replica's group of two
    1-CPU bundles (PACK) fills one of the two 2-CPU nodes, so the replicas run on different
    nodes; concurrent greedy completions equal one engine's (DP=1, TP=1). Killing the actor of
    the replica running a stream fails that stream with a 503 naming the replica, ``/health``
    says degraded, the other replica serves on; stopping the server frees both groups."""
    from tests.engine.test_data_parallel import complete, kill_replica_mid_stream, stats

    prompts = [f"Item {i}: the {color} door opens" for i, color in enumerate(["red", "old"] * 2)]
    llm = LLM(tiny_qwen3, **ENGINE)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8)
        expected = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    finally:
        llm.llm_engine.shutdown()
    server = RemoteServer(
        ["--model", tiny_qwen3, "--tp", "2", "-dp", "2", "--dtype", "float32"]
        + ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
        + ["--max-model-len", "256", "--kv-cache-memory", "0.05", "--disable-log-stats"],
        startup_timeout=150,
        env={**cluster.env, "OMP_NUM_THREADS": "1"},  # 1 CPU a bundle, whatever the host
    )
    with server, ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], prompts))
        assert served == expected
        replicas = stats(server)["replicas"]
        assert all(r["routed_requests"] for r in replicas), replicas
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert {r["node_id"] for r in replicas} == nodes, (replicas, nodes)
        assert "Ray actor on node " in server.output()

        def kill(replica: dict) -> None:
            actor = _named_actor(f"pyxllm-dp-replica{replica['replica']}-")
            ray.kill(actor, no_restart=True)

        victim, error = kill_replica_mid_stream(server, kill, max_tokens=200)
        assert f"(pid {victim['pid']}, Ray actor on node {victim['node_id'][:8]} at " in error
        assert " died" in error, error
        for i in range(2):
            assert complete(server, f"Still there {i}?", max_tokens=2)["choices"][0]["text"]
    assert server.proc.returncode == 0, server.output()[-3000:]
    assert _free_cpus(4.0) == 4.0  # both groups freed, the rank actors gone with them


def test_a_killed_actor_fails_the_request_and_the_server_exits_naming_it(cluster, tiny_qwen3):
    """docs/parallelism.md, "Ray": the in-flight request fails, ``/health`` answers 503 naming
    the rank, and the server exits with status 1 naming the rank and its node, as with the mp
    backend."""
    server = RemoteServer(
        ["--model", tiny_qwen3, "--tp", "2", "--served-model-name", "tp"]
        + ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
        + ["--max-model-len", "256", "--kv-cache-memory", "0.05", "--dist-init-timeout", "90"],
        startup_timeout=150,
        env=cluster.env,
    )
    with server:
        assert "Ray actors on" in server.output()
        kill = partial(ray.kill, _named_actor("pyxllm-tp-rank1-"), no_restart=True)
        unhealthy = kill_mid_stream(server, kill, "TP worker rank 1")
        assert server.proc.poll() == 1
    assert unhealthy and all("TP worker rank 1 (Ray actor, pid" in m for m in unhealthy)
    output = server.output()
    assert "error: TP worker rank 1 (Ray actor, pid" in output, output[-3000:]
    assert " on node " in unhealthy[0] and " died" in unhealthy[0], unhealthy[0]
