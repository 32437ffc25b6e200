"""The OpenAI-compatible server end to end: a real ``pyxllm serve`` process on the default
model, driven with the ``openai`` SDK and raw HTTP."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.utils import RemoteServer

MODEL_NAME = "smollm2-test"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    args = [
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "0.25",
    ]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def wait_until_idle(server: RemoteServer, timeout: float = 10.0) -> dict:
    """Poll ``/debug/stats`` until nothing runs and no KV block is used; return the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(server.url_for("debug", "stats"), timeout=5).json()
        if stats["num_running"] == 0 and stats["num_kv_blocks_used"] == 0:
            return stats
        assert time.monotonic() < deadline, f"request not freed after {timeout} s: {stats}"
        time.sleep(0.02)


def test_health_and_stats(server):
    assert httpx.get(server.url_for("health")).status_code == 200
    stats = httpx.get(server.url_for("debug", "stats")).json()
    assert {"num_running", "num_waiting", "num_kv_blocks_total", "num_kv_blocks_used"} <= set(stats)
    assert stats["num_kv_blocks_total"] > 0


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    raw = httpx.get(server.url_for("v1", "models")).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 512
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_capital_of_france(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=16
    )
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL_NAME and response.created > 0
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    finish = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert content_chunks[-1].choices[0].finish_reason is not None
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage == full.usage


def test_completion_non_stream_and_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt="def fibonacci(n):", temperature=0, max_tokens=10)
    full = client.completions.create(**kwargs)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_completion_prompt_forms(client, hf_gguf_tokenizer):
    kwargs = dict(model=MODEL_NAME, temperature=0, max_tokens=4)
    text = client.completions.create(prompt="The sky is", **kwargs)
    listed = client.completions.create(prompt=["The sky is"], **kwargs)
    ids = hf_gguf_tokenizer.encode("The sky is")
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert listed.choices[0].text == text.choices[0].text == by_ids.choices[0].text
    assert listed.usage == text.usage == by_ids.usage
    assert text.usage.prompt_tokens == len(ids)


def test_usage_is_consistent(client):
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL, max_tokens=5, temperature=0
    )
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL, max_tokens=5, temperature=0.8, seed=1
    )
    for usage in (first.usage, second.usage):
        assert usage.prompt_tokens > 5
        assert 1 <= usage.completion_tokens <= 5
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_stop_string_and_max_completion_tokens(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CAPITAL,
        temperature=0,
        max_completion_tokens=16,
        stop=["Paris"],
    )
    choice = response.choices[0]
    assert "Paris" not in choice.message.content
    assert choice.finish_reason == "stop"


def test_missing_model_means_served_model(server):
    body = {"messages": CAPITAL, "max_tokens": 2}
    response = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
    assert response.status_code == 200 and response.json()["model"] == MODEL_NAME


def test_concurrent_requests(client):
    """Seeded requests sent together get the texts they get one at a time (a request's samples
    depend on its own seed only)."""

    def one(i: int) -> str:
        response = client.completions.create(
            model=MODEL_NAME, prompt=f"Count to {i}:", max_tokens=6, temperature=0.7, seed=i
        )
        assert response.choices[0].finish_reason in ("stop", "length")
        return response.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4)))
    alone = [one(i) for i in range(4)]
    assert together == alone and all(alone)


def test_stream_disconnect_aborts(server):
    wait_until_idle(server)
    body = {
        "model": MODEL_NAME,
        "messages": CAPITAL,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url_for("v1", "chat", "completions"), json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                assert json.loads(line[6:])["object"] == "chat.completion.chunk"
                seen += 1
                if seen == 3:
                    # Still reading: the request runs. (Leaving this loop closes the socket.)
                    stats = http.get(server.url_for("debug", "stats")).json()
                    assert stats["num_running"] == 1 and stats["num_kv_blocks_used"] > 0
                    break
    wait_until_idle(server, timeout=5.0)
    assert httpx.get(server.url_for("health")).status_code == 200


def test_non_stream_disconnect_aborts(server):
    wait_until_idle(server)
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1", "completions"), json=body, timeout=1.0)
    wait_until_idle(server, timeout=5.0)
    assert httpx.get(server.url_for("health")).status_code == 200


def test_every_request_gets_an_access_log_line_written_when_it_ends(server, client):
    kwargs = dict(model=MODEL_NAME, prompt="Hello", max_tokens=4)
    list(client.completions.create(stream=True, **kwargs))
    assert httpx.get(server.url_for("no/such/path")).status_code == 404
    log = server.output()
    stream = re.search(r'"POST /v1/completions HTTP/1.1" 200 (\d+\.\d) ms', log)
    assert stream and float(stream.group(1)) > 0
    assert '"GET /no/such/path HTTP/1.1" 404' in log
