"""``--data-parallel-size``: the router alone, then real ``pyxllm serve`` processes with two
replicas.

- The router's rules (pure Python): the prefix match ratio, the least-loaded choice and its
  ties, the rebalance, round robin over live replicas, the prefix index's eviction; the merged
  Prometheus totals; the CPU split.
- A ``cache_aware`` server: 16 concurrent greedy completions equal the offline engine's (one
  engine, DP=1) and reach both replicas; chats sharing a long system prompt all land on one
  replica, whose metrics show the prefix-cache hits; a stream closed early is aborted on its
  replica, which frees its KV blocks.
- A ``round_robin`` server: the same shared-prompt chats reach both replicas; then its
  replicas are killed one by one: with one left, requests still succeed and ``/health`` says
  degraded (the request running on the killed one fails with a 503 error); with none, 503 and
  the server exits with status 1 naming them. This test ends that server, so it comes last.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyxllm.engine.data_parallel.router import (
    NoReplicaError,
    PrefixIndex,
    Router,
    prompt_block_hashes,
)
from tests.utils import RemoteServer

ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.1"]
SERVER_ARGS = [*ENGINE_ARGS, "--disable-web-ui", "--disable-log-stats", "--data-parallel-size", "2"]
PROMPTS = [f"Item {i}: the {['red', 'blue', 'green', 'old'][i % 4]} door opens" for i in range(16)]
SYSTEM = (
    "You are the front desk of the Harbour View Hotel. Check-in starts at three in the afternoon "
    "and check-out is at eleven in the morning. Breakfast is served from seven to ten in the "
    "garden room, the pool is open from eight to eight, and the spa takes bookings at the "
    "reception. Parking costs twelve dollars a night; pets under ten kilograms are welcome. "
    "Answer in one short sentence."
)


# --- the router, alone ------------------------------------------------------------------------


def test_the_prefix_rule_needs_a_cached_share_of_the_prompt():
    router = Router(2, "cache_aware", block_size=4, cache_blocks=100)
    system = list(range(100, 140))  # 10 blocks
    first = router.route([*system, 1, 2])
    assert (first.replica, first.reason) == (0, "least_loaded")
    router.release(0)
    again = router.route([*system, 3])
    assert (again.replica, again.reason, again.matched_tokens) == (0, "prefix", 40)
    # 12 tokens held of 40: exactly the 0.3 ratio is enough ...
    ratio = router.route([*system[:12], *range(500, 528)])
    assert (ratio.replica, ratio.reason, ratio.matched_tokens) == (0, "prefix", 12)
    # ... 8 of 40 is not: the least loaded replica (1) takes it
    low = router.route([*system[:8], *range(600, 632)])
    assert (low.replica, low.reason) == (1, "least_loaded")
    # a partial block is never a match
    assert prompt_block_hashes([1, 2, 3], 4) == []


def test_least_loaded_takes_the_fewest_unfinished_requests():
    router = Router(3, "least_loaded")
    assert [router.route([7]).replica for _ in range(3)] == [0, 1, 2]
    router.release(1)
    assert router.route([7]).replica == 1  # 1 has none left
    router.route([7], weight=4)  # n=4 counts 4: replica 0 now holds 5
    assert router.loads == [5, 1, 1]
    router.release(2)
    assert router.route([7]).replica == 2
    # ties go to the replica sent the fewest requests so far
    fresh = Router(2, "least_loaded")
    fresh.route([1])
    fresh.release(0)
    assert fresh.route([1]).replica == 1


def test_cache_aware_rebalances_when_the_cached_replica_runs_far_ahead():
    router = Router(2, "cache_aware", block_size=4, cache_blocks=100, balance_abs=3)
    prefix = list(range(32))
    chosen = [router.route([*prefix, i]) for i in range(5)]
    assert [d.replica for d in chosen[:4]] == [0, 0, 0, 0]
    assert (chosen[4].replica, chosen[4].reason) == (1, "rebalance")
    # both now hold the prefix: the less loaded of them gets the next one by the prefix rule
    nxt = router.route([*prefix, 9])
    assert (nxt.replica, nxt.reason) == (1, "prefix")
    # a small imbalance is no reason to leave the cache
    calm = Router(2, "cache_aware", block_size=4, cache_blocks=100)
    assert {calm.route([*prefix, i]).replica for i in range(10)} == {0}


def test_round_robin_and_removed_replicas():
    router = Router(3, "round_robin")
    assert [router.route([1]).replica for _ in range(4)] == [0, 1, 2, 0]
    router.remove(1)
    assert [router.route([1]).replica for _ in range(3)] == [2, 0, 2]
    cache = Router(2, "cache_aware", block_size=4, cache_blocks=100)
    cache.route(list(range(16)))
    cache.remove(0)  # what it cached is forgotten with it
    assert cache.route(list(range(16))).replica == 1
    cache.remove(1)
    with pytest.raises(NoReplicaError):
        cache.route([1])
    with pytest.raises(ValueError, match="--dp-routing"):
        Router(2, "random")


def test_the_prefix_index_evicts_least_recently_used_blocks_tail_first():
    index = PrefixIndex(capacity=4)
    a = prompt_block_hashes(list(range(12)), 4)  # 3 blocks
    b = prompt_block_hashes(list(range(100, 108)), 4)  # 2 blocks
    index.insert(a)
    assert index.match(a) == 3
    index.insert(b)  # 5 blocks > 4: a's last block goes first
    assert (len(index), index.match(a), index.match(b)) == (4, 2, 2)
    index.insert(a[:2])  # a's head used again: b's tail is now the oldest
    index.insert(prompt_block_hashes(list(range(200, 204)), 4))
    assert (index.match(a), index.match(b)) == (2, 1)


def test_cores_are_split_into_whole_physical_cores():
    from pyxllm.engine.data_parallel.launcher import split_cores

    cores = [(0, 4), (1, 5), (2, 6)]  # three cores, two hyper-threads each
    assert split_cores(cores, 2) == [(0, 4, 1, 5), (2, 6)]
    assert split_cores(cores, 3) == [(0, 4), (1, 5), (2, 6)]
    assert split_cores(cores, 4) is None


def test_merged_metrics_label_each_replica_and_total_them():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from pyxllm.engine.data_parallel.metrics import merge_metrics, total_stats
    from pyxllm.engine.data_parallel.wire import ScrapeReply

    def exposition(hits: int, usage: float) -> str:
        registry = CollectorRegistry()
        Counter("vllm:prefix_cache_hits", "h", ["model_name"], registry=registry).labels("m").inc(
            hits
        )
        Gauge("vllm:kv_cache_usage_perc", "u", ["model_name"], registry=registry).labels("m").set(
            usage
        )
        return generate_latest(registry).decode()

    replies = {
        0: ScrapeReply(0, {"num_kv_blocks_total": 100, "num_running": 2}, exposition(5, 0.5)),
        1: ScrapeReply(0, {"num_kv_blocks_total": 300, "num_running": 1}, exposition(7, 0.1)),
    }
    samples = {}
    for family in merge_metrics(replies):
        for s in family.samples:
            samples[(s.name, s.labels.get("replica"))] = s.value
    assert samples[("vllm:prefix_cache_hits_total", "0")] == 5
    assert samples[("vllm:prefix_cache_hits_total", "1")] == 7
    assert samples[("vllm:prefix_cache_hits_total", None)] == 12
    # usage: (0.5 * 100 + 0.1 * 300) / 400 blocks
    assert samples[("vllm:kv_cache_usage_perc", None)] == pytest.approx(0.2)
    created = [samples[("vllm:prefix_cache_hits_created", r)] for r in ("0", "1")]
    assert samples[("vllm:prefix_cache_hits_created", None)] == min(created)
    assert total_stats([r.stats for r in replies.values()]) == {
        "num_kv_blocks_total": 400,
        "num_running": 3,
    }


def test_outputs_cross_as_deltas_and_are_rebuilt_whole():
    from types import SimpleNamespace

    from pyxllm import SamplingParams
    from pyxllm.engine.data_parallel.replica import _ChannelSink
    from pyxllm.engine.data_parallel.replica_client import InFlightRequest
    from pyxllm.engine.input_processor import EngineRequest
    from pyxllm.outputs import CompletionOutput, Logprob, RequestOutput

    messages = []
    engine = SimpleNamespace(requests={"r": None}, parents={})
    sink = _ChannelSink(SimpleNamespace(send=messages.append), engine)
    request = EngineRequest("r", [5, 6, 7], "a prompt", SamplingParams(n=2), 0.0)
    in_flight = InFlightRequest(request, 0, stream=None)
    prompt_logprobs = [None, {6: Logprob(-1.0)}, {7: Logprob(-2.0)}]

    def full(step: int, finished: bool = False) -> RequestOutput:
        completions = [
            CompletionOutput(
                i,
                "".join(f"<{i}.{t}>" for t in range(step)),
                [10 * i + t for t in range(step)],
                "length" if finished else None,
                logprobs=[{10 * i + t: Logprob(-0.5 * t)} for t in range(step)],
            )
            for i in range(2)
        ]
        return RequestOutput("r", "a prompt", [5, 6, 7], completions, finished, prompt_logprobs)

    for step in range(1, 5):
        whole = full(step, finished=step == 4)
        sink.deliver([whole])
        delta = messages[-1].outputs[0]
        assert delta.prompt_token_ids == [] and delta.prompt is None
        assert [len(c.token_ids) for c in delta.outputs] == [1, 1]
        assert (delta.prompt_logprobs is None) == (step > 1)
        assert in_flight.merge(delta) == whole
    assert sink._sent == {}  # a finished request is forgotten


def test_a_pooled_output_crosses_whole_less_its_prompt():
    from types import SimpleNamespace

    import torch

    from pyxllm import SamplingParams
    from pyxllm.engine.data_parallel.replica import _ChannelSink
    from pyxllm.engine.data_parallel.replica_client import InFlightRequest
    from pyxllm.engine.input_processor import EngineRequest
    from pyxllm.outputs import PoolingOutput, PoolingRequestOutput

    messages = []
    engine = SimpleNamespace(requests={}, parents={})
    sink = _ChannelSink(SimpleNamespace(send=messages.append), engine)
    request = EngineRequest("e", [101, 7, 102], "a text", SamplingParams(max_tokens=1), 0.0)
    whole = PoolingRequestOutput("e", "a text", [101, 7, 102], PoolingOutput(torch.ones(4)))
    sink.deliver([whole])
    [sent] = messages[-1].outputs
    assert (sent.prompt, sent.prompt_token_ids) == (None, [])
    assert sent.outputs is whole.outputs and sink._sent == {}
    assert InFlightRequest(request, 1, stream=None).merge(sent) == whole


def test_replica_channels_probe_a_silent_peer_and_still_carry_messages():
    """Both ends of a replica connection have TCP keepalive and a user timeout, so a replica
    whose node vanishes (no FIN, no RST) ends its channel instead of hanging it; messages still
    cross. (A vanished node cannot be made on one machine without firewall rules.)"""
    import socket
    import threading

    from pyxllm.engine.data_parallel import wire

    key = os.urandom(16)
    listener = wire.listen("127.0.0.1", key)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(wire.Channel(listener.accept())))
    thread.start()
    replica_end = wire.connect(listener.address, key)
    thread.join(timeout=10)
    [server_end] = accepted
    try:
        for channel in (server_end, replica_end):
            sock = socket.socket(fileno=os.dup(channel.conn.fileno()))
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == (
                    wire.KEEPALIVE_IDLE_S
                )
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == (
                    wire.USER_TIMEOUT_MS
                )
            finally:
                sock.close()
        replica_end.send(wire.HelloMessage(3, 1234))
        assert server_end.recv() == wire.HelloMessage(3, 1234)
        replica_end.close()
        assert server_end.recv() is None  # a closed peer still reads as the end
    finally:
        server_end.close()
        listener.close()


def test_data_parallel_flags_and_their_errors(capsys):
    from pyxllm.cli.main import parse_args

    args, _ = parse_args(["serve", "-dp", "2", "--dp-routing", "round_robin"])
    assert (args.data_parallel_size, args.dp_routing) == (2, "round_robin")
    args, _ = parse_args(["serve"])
    assert (args.data_parallel_size, args.dp_routing) == (1, "cache_aware")
    for argv, message in (
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--dp-routing", "random"], "--dp-routing"),
        (["-dp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1:1"], "cannot be combined"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["serve", *argv])
        assert message in capsys.readouterr().err


# --- servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_server():
    with RemoteServer([*SERVER_ARGS, "--dp-routing", "cache_aware"], startup_timeout=240) as s:
        yield s


@pytest.fixture(scope="module")
def rr_server():
    with RemoteServer([*SERVER_ARGS, "--dp-routing", "round_robin"], startup_timeout=240) as s:
        yield s


def stats(server: RemoteServer) -> dict:
    response = httpx.get(server.url_for("debug", "stats"), timeout=10)
    assert response.status_code == 200
    return response.json()


def replica_metric(server: RemoteServer, name: str, **labels: str) -> dict[str | None, float]:
    """``/metrics``' sample ``name`` (with these ``labels``) by its ``replica`` label
    (``None``: the total)."""
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    return {
        sample.labels.get("replica"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    }


def complete_json(server: RemoteServer, body: dict) -> dict:
    response = httpx.post(server.url_for("v1", "completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def complete(server: RemoteServer, prompt: str, max_tokens: int = 8) -> dict:
    return complete_json(server, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def chat(server: RemoteServer, question: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    response = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def offline():
    """One engine in this process, configured as each replica is: the DP=1 reference."""
    from pyxllm import LLM

    llm = LLM(max_model_len=512, kv_cache_memory=0.1)
    yield llm
    llm.llm_engine.shutdown()


def test_greedy_outputs_equal_one_engines(cache_server, offline):
    from pyxllm import SamplingParams

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda p: complete(cache_server, p)["choices"][0]["text"], PROMPTS))
    outputs = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert served == [output.outputs[0].text for output in outputs]
    routed = [replica["routed_requests"] for replica in stats(cache_server)["replicas"]]
    assert all(routed) and sum(routed) == len(PROMPTS), routed


def test_seeded_samples_logprobs_and_constraints_cross_to_the_replicas(cache_server, offline):
    from pyxllm import SamplingParams

    prompt = "The weather today is"
    body = {"prompt": prompt, "max_tokens": 6, "n": 2, "temperature": 0.9, "seed": 11}
    choices = complete_json(cache_server, {**body, "logprobs": 1})["choices"]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=6)
    expected = offline.generate([prompt], params)[0].outputs
    assert [c["text"] for c in choices] == [o.text for o in expected]
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in choices)
    # a constraint is compiled again by the replica that runs it
    body = {"prompt": "Is the sky blue? Answer:", "max_tokens": 4, "temperature": 0}
    body["structured_outputs"] = {"choice": [" yes", " no"]}
    before = [r["routed_requests"] for r in stats(cache_server)["replicas"]]
    with ThreadPoolExecutor(2) as pool:  # at once: the least loaded rule gives each replica one
        answers = list(pool.map(lambda _: complete_json(cache_server, body), range(2)))
    assert all(a["choices"][0]["text"] in (" yes", " no") for a in answers), answers
    after = [r["routed_requests"] for r in stats(cache_server)["replicas"]]
    assert [a - b for a, b in zip(after, before)] == [1, 1]


def test_a_shared_system_prompt_stays_on_one_replica_under_cache_aware(cache_server):
    before = stats(cache_server)["replicas"]
    for i in range(4):  # one at a time: the load never outweighs the cache
        chat(cache_server, f"Question {i}: when is breakfast?")
    after = stats(cache_server)["replicas"]
    routed = [a["routed_requests"] - b["routed_requests"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 4], routed
    home = routed.index(4)
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)]
    system_only = {"messages": [{"role": "system", "content": SYSTEM}]}
    system_only["add_generation_prompt"] = False
    count = httpx.post(cache_server.url_for("tokenize"), json=system_only).json()["count"]
    assert hits[home] >= 3 * (count // 16 * 16) > 0 and hits[1 - home] == 0, (hits, count)
    metric = replica_metric(cache_server, "vllm:prefix_cache_hits_total")
    assert metric[str(home)] == after[home]["prefix_cache_hits"]
    assert metric[None] == metric["0"] + metric["1"]


def aborted(server: RemoteServer) -> dict[str | None, float]:
    """Requests each replica finished as aborted (``None``: the total)."""
    return replica_metric(server, "vllm:request_success_total", finished_reason="abort")


def test_a_stream_closed_early_is_aborted_on_its_replica(cache_server):
    before = aborted(cache_server)
    body = {"prompt": "Count slowly:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cache_server.url_for("v1", "completions"), json=body) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:  # asked before leaving the loop, which closes the connection
                running = [r["num_running"] for r in stats(cache_server)["replicas"]]
                break
    assert sorted(running) == [0, 1], running
    home = running.index(1)
    deadline = time.monotonic() + 15
    while True:
        replicas = stats(cache_server)["replicas"]
        if all(r["num_running"] == 0 and r["num_kv_blocks_used"] == 0 for r in replicas):
            break
        assert time.monotonic() < deadline, replicas
        time.sleep(0.05)
    assert all(r["load"] == 0 for r in replicas)
    after = aborted(cache_server)
    assert after[str(home)] == before[str(home)] + 1  # stopped by the abort, not max_tokens
    assert after[str(1 - home)] == before[str(1 - home)]


def test_round_robin_spreads_a_shared_system_prompt(rr_server):
    for i in range(4):
        chat(rr_server, f"Question {i}: where can I park?")
    replicas = stats(rr_server)["replicas"]
    assert [r["routed_requests"] for r in replicas] == [2, 2]
    assert all(r["prefix_cache_queries"] > 0 and r["prefix_cache_hits"] > 0 for r in replicas)


def read_stream_until_done(lines) -> list[dict]:
    """The JSON events of an SSE stream's ``lines`` up to ``[DONE]``."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                break
            events.append(json.loads(data))
    return events


def kill_replica_mid_stream(server: RemoteServer, kill, max_tokens: int = 400) -> tuple[dict, str]:
    """Stream a long completion from a two-replica ``server``, ``kill(replica)`` the replica
    running it (its ``/debug/stats`` entry) once the first chunk arrives, and check that the
    stream ends with a 503 error naming that replica and that ``/health`` then answers 200,
    degraded, one replica left. Returns the killed replica's entry and its ``/health`` error."""
    body = {"prompt": "Tell a long story:", "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        victim = next(r for r in stats(server)["replicas"] if r["num_running"] == 1)
        kill(victim)
        events = read_stream_until_done(lines)
    assert events[-1]["error"]["code"] == 503, events[-1]
    assert f"data-parallel replica {victim['replica']} (pid" in events[-1]["error"]["message"]
    health = httpx.get(server.url_for("health"), timeout=10)
    assert health.status_code == 200
    detail = health.json()
    assert (detail["status"], detail["replicas_alive"]) == ("degraded", 1), detail
    return victim, detail["replicas"][victim["replica"]]["error"]


def test_killed_replicas_leave_the_others_serving_then_503(rr_server):
    """Ends ``rr_server``: keep it the module's last test."""
    victim, error = kill_replica_mid_stream(rr_server, lambda r: os.kill(r["pid"], signal.SIGKILL))
    assert "killed by SIGKILL" in error
    for i in range(3):
        assert complete(rr_server, f"Still there {i}?", max_tokens=2)["choices"][0]["text"]
    survivor = stats(rr_server)["replicas"][1 - victim["replica"]]
    assert survivor["alive"] and survivor["num_running"] == 0

    os.kill(survivor["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(rr_server.url_for("health"), timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "/health never answered 503"
        time.sleep(0.02)
    assert rr_server.proc.wait(timeout=30) == 1
    assert "every data-parallel replica has died" in rr_server.output()
