"""Tensor parallelism placed by Ray (``--distributed-executor-backend ray``), on a real Ray
cluster this module starts on this machine: a head (``ray start --head``) and a second node
(``ray start --address``), each with its own CPUs and a custom resource, in a temp dir and on
ports of their own, stopped at the end (:class:`tests.utils.RayCluster`). Usage stats are off,
there is no dashboard, the object stores are 100 MB.

- SmolLM2 at ``--tp 3`` (PACK) gives tp=1's greedy tokens; a tiny Qwen3 at ``--tp 2`` with
  STRICT_SPREAD puts one rank on each node and gives tp=1's tokens (the checks of
  tests/test_tensor_parallel.py's ``greedy_tokens``);
- a placement group that cannot be placed fails within ``--dist-init-timeout``, naming what is
  missing, and frees what it held;
- a server whose rank-1 actor is killed mid-request fails that request, answers 503 on
  ``/health`` and exits 1 naming the rank and its node;
- without Ray installed the flag fails with the install command; the flags' errors name them.

The machine has 2 cores shared with other jobs: one cluster for the module, prompts short, every
rank one torch thread (so one CPU per bundle).
"""

from __future__ import annotations

import sys
import time
from functools import partial

import pytest
from model_fixtures import build_checkpoint

from pyxllm import LLM
from pyxllm.distributed.errors import DistributedError
from pyxllm.distributed.ray_utils import describe_shortfall
from tests.test_tensor_parallel import ENGINE, greedy_tokens
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


def _ray(cluster: RayCluster, **engine) -> dict:
    return dict(distributed_executor_backend="ray", ray_address=cluster.address, **engine)


def test_without_ray_the_flag_names_the_install_command(monkeypatch, capsys):
    from pyxllm.entrypoints.args import parse_args

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(SystemExit):
        parse_args(["serve", "--tp", "3", "--distributed-executor-backend", "ray"])
    assert "pip install 'pyxllm[ray]'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"Ray is not installed here; pip install 'pyxllm\[ray\]'"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="ray")


def test_ray_flags_and_their_errors(capsys):
    from pyxllm.entrypoints.args import parse_args

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


def test_tiny_qwen3_tp2_one_rank_per_node_equals_tp1(cluster, tiny_qwen3):
    """STRICT_SPREAD on the two nodes: rank 0 on the node this process joined, rank 1 on the
    other (``greedy_tokens`` checks that their nodes differ)."""
    ref, _ = greedy_tokens(tiny_qwen3, 1)
    got, _ = greedy_tokens(tiny_qwen3, 2, **_ray(cluster, ray_placement_strategy="STRICT_SPREAD"))
    assert got == ref
    assert len({tuple(t) for t in ref}) == len(ref)


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
    deadline = time.monotonic() + 10  # the withdrawn group's CPUs are free again
    while ray.available_resources().get("CPU") != 4.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 4.0


def _rank_actor(rank: int):
    """The handle of the live rank actor named ``pyxllm-tp-rank<rank>-*`` (any namespace)."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(f"pyxllm-tp-rank{rank}-"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no actor of rank {rank}")


def test_a_killed_actor_fails_the_request_and_the_server_exits_naming_it(cluster, tiny_qwen3):
    """README, "Ray": the in-flight request fails, ``/health`` answers 503 naming the rank, and
    the server exits with status 1 naming the rank and its node, as with the mp backend."""
    server = RemoteServer(
        ["--model", tiny_qwen3, "--tp", "2", "--served-model-name", "tp"]
        + ["--distributed-executor-backend", "ray", "--ray-address", cluster.address]
        + ["--max-model-len", "256", "--kv-cache-memory", "0.05", "--dist-init-timeout", "90"],
        startup_timeout=150,
        env=cluster.env,
    )
    with server:
        assert "Ray actors on" in server.output()
        kill = partial(ray.kill, _rank_actor(1), no_restart=True)
        unhealthy = kill_mid_stream(server, kill, "TP worker rank 1")
        assert server.proc.poll() == 1
    assert unhealthy and all("TP worker rank 1 (Ray actor, pid" in m for m in unhealthy)
    output = server.output()
    assert "error: TP worker rank 1 (Ray actor, pid" in output, output[-3000:]
    assert " on node " in unhealthy[0] and " died" in unhealthy[0], unhealthy[0]
