"""KV moved through the Ray object store (``--kv-transfer-push ray://NAME`` on the prefill
instance, ``--kv-transfer-listen ray://NAME`` on the decode instance), on a Ray cluster this
module starts once on this machine (:class:`tests.utils.RayCluster`: one node, 1 logical CPU,
no dashboard, a 100 MB object store), with a tiny random Llama:

- the KV directory's LRU bound, in this process, without Ray;
- a prefill engine and a decode engine in this process, on directories of their own: the decode
  engine reads the prompt's full blocks from the object store and answers the colocated greedy
  tokens; a prompt the directory never held, one whose refs it dropped (LRU), and one whose
  payload carries another tier's digest are computed instead, with the same tokens;
- two ``pyxllm serve`` processes joining the cluster (``--ray-address``) behind the proxy answer
  the colocated greedy tokens, the decode instance reading the prompt's full blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import time

import httpx
import pytest

from tests.engine.test_kv_disagg import BLOCK, ENGINE_ARGS, PROMPT, cached_tokens, greedy, metric
from tests.model_fixtures import build_checkpoint
from tests.utils import RayCluster, RemoteServer, run_together

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(num_cpus=1) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_gguf_tokenizer):
    """A tiny random Llama checkpoint (2 layers, hidden size 64)."""
    directory, _ = build_checkpoint("llama", tmp_path_factory.mktemp("llama"), hf_gguf_tokenizer)
    return str(directory)


@pytest.fixture(scope="module")
def offline(model_dir):
    """One engine in this process, configured as the instances are: the colocated reference."""
    from pyxllm import LLM

    llm = LLM(model=model_dir, max_model_len=256, kv_cache_memory=0.05)
    yield llm
    llm.llm_engine.shutdown()


def test_the_directory_drops_the_least_recently_used_refs():
    from pyxllm.engine.kv_ray import KVDirectory

    directory = KVDirectory(max_bytes=30)
    directory.register("d", [(b"a", 10, ["ref a"]), (b"b", 10, ["ref b"])])
    assert directory.lookup("d", [b"a", b"x"]) == [["ref a"], None]  # a: now the newest
    assert directory.lookup("e", [b"a"]) == [None]  # another tier's digest
    assert directory.register("d", [(b"c", 10, ["ref c"]), (b"e", 10, ["ref e"])]) == 3
    assert directory.lookup("d", [b"a", b"b", b"c", b"e"]) == [
        ["ref a"],
        None,
        ["ref c"],
        ["ref e"],
    ]
    directory.register("d", [(b"c", 10, ["new c"])])  # registered again: replaced
    assert directory.lookup("d", [b"c"]) == [["new c"]]
    assert directory.resize(10) == 2
    assert directory.stats() == {"blocks": 1, "bytes": 10, "max_bytes": 10, "evicted": 3}


def test_kv_moves_through_the_object_store_and_a_miss_is_computed(
    model_dir, cluster, tmp_path, offline
):
    from pyxllm import LLM, SamplingParams

    common = {"model": model_dir, "max_model_len": 256, "kv_cache_memory": 0.05}
    decode_dir, prefill_dir = tmp_path / "decode", tmp_path / "prefill"
    decode = LLM(
        **common,
        kv_offload_dir=str(decode_dir),
        kv_role="decode",
        kv_transfer_listen="ray://in-process",
    )
    prefill = LLM(
        **common,
        kv_offload_dir=str(prefill_dir),
        kv_role="prefill",
        kv_transfer_push=("ray://in-process",),
    )
    one, six = (SamplingParams(temperature=0, max_tokens=n) for n in (1, 6))
    pusher = prefill.llm_engine.kv_connector.transfer
    source = decode.llm_engine.kv_connector.remote
    directory, digest = pusher.directory, pusher.digest
    try:

        def split(prompt: list[int], prefilled: bool = True):
            """Prefill ``prompt`` (when ``prefilled``), then decode it: the decode engine's
            answer, checked against the colocated engine's greedy text."""
            if prefilled:
                prefill.generate([{"prompt_token_ids": prompt}], one)
            [answer] = decode.generate([{"prompt_token_ids": prompt}], six)
            assert answer.outputs[0].text == greedy(offline, [prompt])[0]
            return answer

        assert split([t + 4 for t in PROMPT]).num_cached_tokens == 6 * BLOCK
        assert (pusher.pushed, source.received) == (6, 6)
        assert len(list(decode_dir.glob("*/*/*.kv"))) == 6  # kept in its own directory too
        assert split([t + 5 for t in PROMPT], prefilled=False).num_cached_tokens == 0
        assert source.received == 6

        # the directory drops the oldest refs: the prompt's leading blocks are gone
        third = [t + 6 for t in PROMPT]
        prefill.generate([{"prompt_token_ids": third}], one)
        block_bytes = decode.llm_engine.kv_connector.tier.block_bytes
        assert ray.get(directory.resize.remote(2 * block_bytes)) == 10
        assert split(third, prefilled=False).num_cached_tokens == 0
        assert source.received == 6
        ray.get(directory.resize.remote(2**30))

        # the first block's ref replaced by one to its payload under another tier's digest
        fourth, before = [t + 7 for t in PROMPT], len(pusher.sent)
        prefill.generate([{"prompt_token_ids": fourth}], one)
        first = list(pusher.sent)[before]
        payload = prefill.llm_engine.kv_connector.tier.load(first)
        foreign = ray.put(("0" * len(digest), hashlib.sha256(payload).hexdigest(), payload))
        ray.get(directory.register.remote(digest, [(first, len(payload), [foreign])]))
        assert split(fourth, prefilled=False).num_cached_tokens == 0
        # refused, and the blocks after it not fetched (a run of hits ends at the first miss)
        assert (source.received, source.refused, source.failed) == (6, 1, 0)
    finally:
        prefill.llm_engine.shutdown()
        decode.llm_engine.shutdown()
        ray.kill(directory)


def test_two_servers_on_the_cluster_answer_as_one_engine(model_dir, cluster, tmp_path, offline):
    """``pyxllm serve`` prefill and decode instances joining the cluster, each on a directory
    of its own, behind the proxy (in this process)."""
    from fastapi.testclient import TestClient

    from pyxllm.entrypoints.disagg_proxy import DisaggProxy, build_proxy_app

    args = [model_dir, *ENGINE_ARGS, "--ray-address", cluster.address, "--kv-offload-dir"]
    prefill = RemoteServer(
        [*args, str(tmp_path / "p"), "--kv-role", "prefill", "--kv-transfer-push", "ray://e2e"],
        env=cluster.env,
    )
    decode = RemoteServer(
        [*args, str(tmp_path / "d"), "--kv-role", "decode", "--kv-transfer-listen", "ray://e2e"],
        env=cluster.env,
    )
    try:
        run_together(prefill.__enter__, decode.__enter__)  # both start at once
        proxy = DisaggProxy([prefill.url_for("")], [decode.url_for("")], 120)
        prompt = [t + 8 for t in PROMPT]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        with TestClient(build_proxy_app(proxy)) as client:
            answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == greedy(offline, [prompt])[0]
        assert cached_tokens(answer.json()) == 6 * BLOCK
        received = metric(decode, "pyxllm:kv_transfer_blocks_total", outcome="received")
        pushed = metric(prefill, "pyxllm:kv_transfer_blocks_total", outcome="pushed")
        assert (received[None], pushed[None]) == (6, 6)

        # a prompt prefilled, then its prefill instance gone: its blocks, objects it owned,
        # are lost with it, or (this tiny model's blocks of a few KB: Ray keeps objects under
        # 100 KB inside the refs) still whole; either way the answer comes, the same
        lost = [t + 9 for t in PROMPT]
        one = {"prompt": lost, "max_tokens": 1, "temperature": 0}
        assert httpx.post(prefill.url_for("v1", "completions"), json=one).status_code == 200
        prefill.stop()
        start = time.monotonic()
        answer = httpx.post(
            decode.url_for("v1", "completions"), json={**body, "prompt": lost}, timeout=120
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == greedy(offline, [lost])[0]
        assert time.monotonic() - start < 60
    finally:
        prefill.stop()
        decode.stop()
        with contextlib.suppress(ValueError):  # none when neither instance started
            ray.kill(ray.get_actor("pyxllm-kv-e2e", namespace="pyxllm"))
