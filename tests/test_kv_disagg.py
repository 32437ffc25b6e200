"""The disk KV tier (``--kv-offload-dir``) across processes, on a tiny random Llama served by
real ``pyxllm serve`` subprocesses:

- two data-parallel replicas on one directory: a prompt computed on one replica is read back
  by the other (``cached_tokens``, and the replica's ``/metrics``);
"""

from __future__ import annotations

import httpx
import pytest
from model_fixtures import build_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from tests.utils import RemoteServer

BLOCK = 16
ENGINE_ARGS = ["--max-model-len", "256", "--kv-cache-memory", "0.05", "--disable-log-stats"]
ENGINE_ARGS += ["--disable-web-ui", "--enable-prompt-tokens-details"]
# 103 tokens: 6 full blocks of 16 and a partial one of 7
PROMPT = [(i * 37) % 40000 + 100 for i in range(103)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_gguf_tokenizer):
    """A tiny random Llama checkpoint (2 layers, hidden size 64)."""
    directory, _ = build_checkpoint("llama", tmp_path_factory.mktemp("llama"), hf_gguf_tokenizer)
    return str(directory)


def complete(server: RemoteServer, prompt, max_tokens: int = 6, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    response = httpx.post(server.url_for("v1", "completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server: RemoteServer, name: str, **labels: str) -> dict[str | None, float]:
    """``/metrics``' sample ``name`` (with these ``labels``) by its ``replica`` label (``None``
    for a server without replicas, or the replicas' total)."""
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    return {
        sample.labels.get("replica"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    }


def test_data_parallel_replicas_share_the_directory(model_dir, tmp_path):
    args = [model_dir, *ENGINE_ARGS, "--kv-offload-dir", str(tmp_path)]
    args += ["--data-parallel-size", "2", "--dp-routing", "round_robin"]
    with RemoteServer(args, startup_timeout=240) as server:
        first = complete(server, PROMPT)  # replica 0 computes it and writes its blocks
        second = complete(server, PROMPT)  # replica 1 has never seen it
        assert cached_tokens(first) == 0
        assert cached_tokens(second) == 6 * BLOCK
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        hits = metric(server, "vllm:external_prefix_cache_hits_total")
        assert (hits["0"], hits["1"], hits[None]) == (0, 6 * BLOCK, 6 * BLOCK)
        written = metric(server, "pyxllm:kv_offload_blocks_total", transfer_type="CPU_to_DISK")
        assert (written["0"], written["1"]) == (6, 0)
    assert len(list(tmp_path.glob("*/*/*.kv"))) == 6
