"""A real ``pyxllm serve``: 64 concurrent chats sharing a long system prompt, and ``/metrics``.

The 64 chats are 16 distinct ones, 4 times each. Their concurrent outputs (batched, with
prefix-cache hits on the system prompt and on whole identical prompts) must equal the 16 run
one at a time; afterwards no KV block is in use, and the Prometheus metrics show the hits.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils import RemoteServer

MODEL_NAME = "smollm2-metrics"
NUM_REQUESTS = 64
NUM_DISTINCT = 16
SYSTEM = (
    "You are the help desk of the Riverside Community Library. The library opens at nine in the "
    "morning and closes at six in the evening from Monday to Saturday; it is closed on Sundays and "
    "public holidays. Members may borrow up to eight items at a time for three weeks, and renew "
    "each item twice unless another member has reserved it. Late returns cost twenty cents per "
    "item per day, up to five dollars per item. Children's story time is on Wednesday at ten, the "
    "chess club meets on Thursday evenings, and the computer lab can be booked for one hour a day. "
    "Answer every question in one short, friendly sentence, and never invent facts."
)
METRIC_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
}


def messages(i: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question {i}: can I borrow {i % 9 + 1} books?"},
    ]


@pytest.fixture(scope="module")
def server():
    args = [
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "0.25",
        "--max-tokens-per-batch",
        "1024",
        "--stats-interval",
        "1",
    ]
    with RemoteServer(args) as remote:
        yield remote


def scrape(server: RemoteServer) -> dict:
    """``/metrics`` as ``{sample name + [label=value]...: value}`` plus ``"families"`` (the
    metric names); checks that every vllm sample carries this server's ``model_name``."""
    response = httpx.get(server.url_for("metrics"), timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if not family.name.startswith("vllm:"):
                continue
            assert sample.labels["model_name"] == MODEL_NAME
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "le")}
            key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))
            if "le" not in sample.labels:
                samples[key] = sample.value
        samples.setdefault("families", set()).add(family.name)
    return samples


def wait_until_idle(server: RemoteServer, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(server.url_for("debug", "stats"), timeout=5).json()
        if stats["num_running"] == stats["num_waiting"] == stats["num_kv_blocks_used"] == 0:
            return stats
        assert time.monotonic() < deadline, f"blocks still in use after {timeout} s: {stats}"
        time.sleep(0.05)


async def chat_all(
    server: RemoteServer, indices: list[int], concurrent: bool
) -> list[tuple[str, str]]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[str, str]:
        response = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages(i), max_tokens=8, temperature=0
        )
        choice = response.choices[0]
        return choice.message.content, choice.finish_reason

    try:
        if concurrent:
            return list(await asyncio.gather(*(one(i) for i in indices)))
        return [await one(i) for i in indices]
    finally:
        await client.close()


def test_metrics_before_traffic(server):
    samples = scrape(server)
    assert METRIC_NAMES <= samples["families"]
    assert samples["vllm:num_requests_running"] == 0
    assert samples["vllm:prefix_cache_hits_total"] == 0


def test_shared_system_prompt_concurrent_equals_sequential(server):
    indices = [i % NUM_DISTINCT for i in range(NUM_REQUESTS)]
    concurrent = asyncio.run(chat_all(server, indices, concurrent=True))
    wait_until_idle(server)
    after_burst = scrape(server)
    assert all(text and reason in ("stop", "length") for text, reason in concurrent)
    assert (
        after_burst["vllm:request_success_total[finished_reason=length]"]
        + after_burst["vllm:request_success_total[finished_reason=stop]"]
        == NUM_REQUESTS
    )
    # every request but the first hit (at least) the system prompt's full blocks
    assert after_burst["vllm:prefix_cache_hits_total"] >= (NUM_REQUESTS - 1) * 128
    sequential = asyncio.run(chat_all(server, list(range(NUM_DISTINCT)), concurrent=False))
    assert len(set(sequential)) > 1
    assert concurrent == [sequential[i] for i in indices]
    wait_until_idle(server)


def test_metrics_after_traffic(server):
    samples = scrape(server)
    assert METRIC_NAMES <= samples["families"]
    total = NUM_REQUESTS + NUM_DISTINCT
    finished = sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total["))
    assert finished == total
    assert samples["vllm:request_success_total[finished_reason=abort]"] == 0
    assert samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:kv_cache_usage_perc"] == 0
    assert 0 < samples["vllm:prefix_cache_hits_total"] < samples["vllm:prefix_cache_queries_total"]
    assert samples["vllm:num_preemptions_total"] == 0  # so each prompt was looked up once:
    assert samples["vllm:prompt_tokens_total"] == samples["vllm:prefix_cache_queries_total"]
    assert samples["vllm:time_to_first_token_seconds_count"] == total
    assert samples["vllm:e2e_request_latency_seconds_count"] == total
    generated = samples["vllm:generation_tokens_total"]
    assert total <= generated <= total * 8
    assert samples["vllm:inter_token_latency_seconds_count"] == generated - total
    assert samples["vllm:time_to_first_token_seconds_sum"] > 0


def test_the_log_shows_stats_lines_while_there_is_work(server):
    """The periodic stats line came while the chats ran, and none comes while idle."""
    time.sleep(1.5)  # the line of the interval in which the last chats finished
    lines = [line for line in server.output().splitlines() if "Avg prompt throughput" in line]
    assert lines, server.output()[-3000:]
    rates = [float(line.split("Prefix cache hit rate: ")[1].rstrip("%")) for line in lines]
    assert max(rates) > 0
    assert all("Running: " in line and "KV cache usage: " in line for line in lines)
    assert "\r" not in server.output()  # no progress bar redraws in a log that is no terminal
    time.sleep(2.5)  # idle for more than two intervals
    assert server.output().count("Avg prompt throughput") == len(lines)
