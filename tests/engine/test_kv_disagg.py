"""The disk KV tier (``--kv-offload-dir``) across processes, on a tiny random Llama served by
real ``pyxllm serve`` subprocesses:

- two data-parallel replicas on one directory: a prompt computed on one replica is read back
  by the other (``cached_tokens``, and the replica's ``/metrics``);
- prefill/decode disaggregation: a prefill instance and a decode instance on one directory
  behind ``pyxllm disagg-proxy`` answer completions and chats, streamed or not, with the
  offline engine's greedy tokens, and so do the Responses and Anthropic Messages APIs through
  the ``openai`` and ``anthropic`` SDKs; the decode instance reads each prompt's full blocks
  and computes the partial last one; with the prefill instance killed, the decode instance
  computes the prompt itself and the answer is the same;
- the same prefill instance also pushes its blocks over TCP to two recording stand-ins of
  decode instances: a Responses or Messages request through a proxy that names its decode
  instance (``kv_transfer_params``) pushes there only;
- over TCP between engines in this process: pushes are signed (HMAC-SHA256 of the shared
  secret, never the secret), and unsigned, wrongly signed or stale pushes are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import re
import signal
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.model_fixtures import build_checkpoint
from tests.utils import RemoteServer, run_together

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


class ProxyServer(RemoteServer):
    """``python -m pyxllm disagg-proxy --port <free port> *args`` in a subprocess."""

    def __init__(self, args: list[str]):
        super().__init__(args, startup_timeout=60)
        self.args[3] = "disagg-proxy"


class RecordingPeer:
    """A stand-in for a decode instance, on one port of this process: it records the KV blocks
    pushed to it (``PUT /kv/...``, answered 204, as ``--kv-transfer-listen`` does) and the
    requests sent to it (``POST``, answered 200 with ``{}``).

    Attributes:
        address: ``127.0.0.1:PORT``.
        blocks: the paths of the blocks pushed, in order; posts: ``(path, body)`` of each POST.
    """

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.blocks: list[str] = []
        self.posts: list[tuple[str, dict]] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
                self.body()
                peer.blocks.append(self.path)
                self.answer(204, b"")

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                peer.posts.append((self.path, json.loads(self.body())))
                self.answer(200, b"{}")

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.address = f"127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def peers():
    """Two :class:`RecordingPeer` s the module's prefill instance also pushes to."""
    made = [RecordingPeer(), RecordingPeer()]
    yield made
    for peer in made:
        peer.close()


@pytest.fixture(scope="module")
def disaggregated(model_dir, tmp_path_factory, peers):
    """``(proxy, prefill instance, decode instance)`` on one directory; the prefill instance
    also pushes its blocks over TCP to ``peers`` (which the proxy does not know)."""
    shared = str(tmp_path_factory.mktemp("kv"))
    args = [model_dir, *ENGINE_ARGS, "--kv-offload-dir", shared, "--kv-role"]
    push = ["--kv-transfer-push", *(peer.address for peer in peers)]
    prefill, decode = RemoteServer([*args, "prefill", *push]), RemoteServer([*args, "decode"])
    try:
        run_together(prefill.__enter__, decode.__enter__)  # both start at once
        urls = ["--prefill", prefill.url_for(""), "--decode", decode.url_for("")]
        with ProxyServer(urls) as proxy:
            yield proxy, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    """One engine in this process, configured as the instances are: the colocated reference."""
    from pyxllm import LLM

    llm = LLM(model=model_dir, max_model_len=256, kv_cache_memory=0.05)
    yield llm
    llm.llm_engine.shutdown()


def greedy(llm, prompts: list, max_tokens: int = 6) -> list[str]:
    from pyxllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [output.outputs[0].text for output in outputs]


def stream_text(server: RemoteServer, route: str, body: dict) -> str:
    """The text of a streamed answer, its chunks joined."""
    text = []
    with httpx.stream("POST", server.url_for("v1", route), json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                choice = json.loads(line[5:])["choices"][0]
                text.append(choice["text"] if "text" in choice else choice["delta"].get("content"))
    return "".join(t or "" for t in text)


def test_prefill_and_decode_instances_answer_as_one_engine(disaggregated, offline):
    proxy, prefill, decode = disaggregated
    # 103 tokens (6 full blocks and 7 tokens), 96 (6 full blocks), 10 (no full block)
    prompts = [PROMPT, [t + 1 for t in PROMPT[:96]], PROMPT[50:60]]
    expected = greedy(offline, prompts)
    answers = run_together(*[lambda p=p: complete(proxy, p) for p in prompts])
    assert [a["choices"][0]["text"] for a in answers] == expected
    # the decode instance read every full block but the one holding the last prompt token
    assert [cached_tokens(a) for a in answers] == [96, 80, 0]
    assert metric(decode, "vllm:external_prefix_cache_hits_total")[None] == 96 + 80
    written = {"transfer_type": "CPU_to_DISK"}
    assert metric(prefill, "pyxllm:kv_offload_blocks_total", **written)[None] == 6 + 6
    assert metric(decode, "pyxllm:kv_offload_blocks_total", **written)[None] == 0
    # streamed, beside the same request unstreamed, and a chat
    body = {"prompt": [t + 2 for t in PROMPT], "max_tokens": 6, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Name three colours. " * 8}]}
    chat.update(max_tokens=6, temperature=0)
    streamed, plain, chat_streamed, chat_plain = run_together(
        lambda: stream_text(proxy, "completions", {**body, "stream": True}),
        lambda: complete(proxy, **body)["choices"][0]["text"],
        lambda: stream_text(proxy, "chat/completions", {**chat, "stream": True}),
        lambda: httpx.post(
            proxy.url_for("v1", "chat", "completions"), json=chat, timeout=120
        ).json()["choices"][0]["message"]["content"],
    )
    assert streamed == plain == greedy(offline, [body["prompt"]])[0]
    from pyxllm import SamplingParams

    reference = offline.chat(chat["messages"], SamplingParams(temperature=0, max_tokens=6))
    assert chat_streamed == chat_plain == reference[0].outputs[0].text
    stats = httpx.get(proxy.url_for("stats")).json()
    assert stats == {"requests": 7, "prefill_failures": 0, "prefill_skipped": 0}
    # the proxy's start-up line in the servers' log format (level, time, logger)
    started = r"^INFO .* pyxllm\.entrypoints\.disagg_proxy: pyxllm disagg-proxy on http://"
    assert re.search(started, proxy.output(), re.MULTILINE), proxy.output()


def test_the_responses_and_messages_apis_go_through_both_instances(disaggregated, offline):
    """Through the real SDKs: a Responses API request and an Anthropic Messages request read
    their prompt's full blocks written by the prefill instance and answer the colocated
    engine's greedy text, streamed or not; a continued response (``previous_response_id``)
    skips the prefill step; errors come back with their status, in their API's shape."""
    from pyxllm import SamplingParams

    proxy, _, decode = disaggregated
    before = httpx.get(proxy.url_for("stats")).json()
    gpt = openai.OpenAI(base_url=proxy.base_url, api_key="EMPTY", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(
        base_url=proxy.url_for(""), api_key="EMPTY", max_retries=0, timeout=120
    )
    model = gpt.models.list().data[0].id  # the decode instance's, through the proxy
    fruits = "Name three fruits. " * 8
    animals = [{"role": "user", "content": "Name three animals. " * 8}]
    ask = {"model": model, "input": fruits, "max_output_tokens": 6, "temperature": 0}
    message = {"model": model, "max_tokens": 6, "messages": animals}
    message["extra_body"] = {"temperature": 0}

    def continued(text):
        return [{"role": "user", "content": fruits}, {"role": "assistant", "content": text}]

    def hits() -> tuple[float, float]:
        """The decode instance's prefix-cache hits: those read from the directory, all."""
        names = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
        return tuple(metric(decode, name)[None] for name in names)

    # each prompt new to both instances but for the chat template's first block(s): the decode
    # instance reads the rest of its full blocks from the directory
    start = hits()
    response = gpt.responses.create(**ask)
    prompt = response.usage.input_tokens
    cached = response.usage.input_tokens_details.cached_tokens
    assert cached == (prompt - 1) // BLOCK * BLOCK > 0
    (tier, every), start = [b - a for a, b in zip(start, hits())], hits()
    assert 0 < tier and every == cached
    answer = claude.messages.create(**message)
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens == (prompt - 1) // BLOCK * BLOCK > 0
    tier, every = [b - a for a, b in zip(start, hits())]
    assert 0 < tier and every == answer.usage.cache_read_input_tokens
    assert claude.messages.count_tokens(model=model, messages=animals).input_tokens == prompt

    def stream_response():
        with gpt.responses.stream(**ask) as events:  # the SDK checks the events' order
            return list(events)[-1].response.output_text  # response.incomplete: max tokens

    def stream_message():
        with claude.messages.stream(**message) as events:
            return events.get_final_message().content[0].text

    follow_up = {**ask, "input": "And three more.", "previous_response_id": response.id}
    streamed, message_streamed, second = run_together(
        stream_response, stream_message, lambda: gpt.responses.create(**follow_up)
    )
    greedy6 = SamplingParams(temperature=0, max_tokens=6)
    conversations = [[{"role": "user", "content": fruits}], animals]
    conversations.append(
        [*continued(response.output_text), {"role": "user", "content": "And three more."}]
    )
    expected = [output.outputs[0].text for output in offline.chat(conversations, greedy6)]
    assert streamed == response.output_text == expected[0]
    assert message_streamed == answer.content[0].text == expected[1]
    assert second.output_text == expected[2]
    assert gpt.responses.retrieve(response.id).output_text == response.output_text

    # a bad value: the decode instance's error, its status and shape kept, streamed or not
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**{**message, "max_tokens": 0}, stream=True)
    assert refused.value.body["error"]["message"].startswith("max_tokens")
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.responses.create(**{**ask, "temperature": -1})
    assert refused.value.body["param"] == "temperature"
    stats = httpx.get(proxy.url_for("stats")).json()
    assert stats["requests"] - before["requests"] == 7
    assert stats["prefill_skipped"] - before["prefill_skipped"] == 1


def test_a_bad_body_is_a_400_naming_it(disaggregated):
    proxy, prefill, decode = disaggregated
    for params in ({"remote_host": "h"}, {"remote_host": "h", "remote_port": "80"}, [1]):
        body = {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params}
        response = httpx.post(prefill.url_for("v1", "completions"), json=body, timeout=60)
        assert response.status_code == 400, params
        assert response.json()["error"]["param"] == "kv_transfer_params"
    # each API's request takes the field on both instances
    params = {"do_remote_decode": True, "remote_host": "h", "remote_port": 1}
    model = httpx.get(decode.url_for("v1", "models")).json()["data"][0]["id"]
    hi = [{"role": "user", "content": "hi"}]
    for route, body in (
        ("completions", {"prompt": "hi", "max_tokens": 1}),
        ("chat/completions", {"messages": hi, "max_tokens": 1}),
        ("responses", {"input": "hi", "max_output_tokens": 1}),
        ("messages", {"model": model, "messages": hi, "max_tokens": 1}),
    ):
        for server in (prefill, decode):
            body["kv_transfer_params"] = params
            answer = httpx.post(server.url_for("v1", route), json=body, timeout=60)
            assert answer.status_code == 200, (route, answer.text)
    body = {"input": "hi", "max_output_tokens": 1, "kv_transfer_params": {"remote_host": "h"}}
    response = httpx.post(prefill.url_for("v1", "responses"), json=body, timeout=60)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "kv_transfer_params")
    response = httpx.post(proxy.url_for("v1", "completions"), content=b"[1, 2")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body"
    response = httpx.post(proxy.url_for("v1", "messages"), content=b"[1, 2")
    assert response.status_code == 400
    assert response.json()["type"] == "error"  # Anthropic's shape on Anthropic's route
    assert response.json()["error"]["message"].startswith("body:")


def test_the_proxy_cuts_each_api_to_one_token_and_follows_stored_responses():
    """In this process, the instances mocked: the prefill request of a Responses request asks
    for one ``max_output_tokens``, unstored, unstreamed; of a Messages request one
    ``max_tokens``; a continued response skips the prefill step and goes, as its retrieval and
    deletion do, to the decode instance that stores it, not the next in turn."""
    from fastapi.testclient import TestClient

    from pyxllm.entrypoints.disagg_proxy import DisaggProxy, build_proxy_app

    sent = []

    def instance(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, str(request.url), body))
        status, body = 200, {"host": request.url.host}
        if request.url.path == "/v1/responses/resp_1":  # stored on d2 only
            status = 200 if request.url.host == "d2" else 404
        # a stream, as an instance's answer is
        return httpx.Response(status, stream=httpx.ByteStream(json.dumps(body).encode()))

    proxy = DisaggProxy(["http://p:1"], ["http://d1:1", "http://d2:1"], timeout=5)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(instance))
    client = TestClient(build_proxy_app(proxy))
    ask = {"input": "hi", "max_output_tokens": 9, "stream": True, "include": ["x"], "top_p": 0.5}
    assert client.post("/v1/responses", json=ask).status_code == 200
    cut = {"input": "hi", "max_output_tokens": 1, "top_p": 0.5, "store": False}
    assert sent == [
        ("POST", "http://p:1/v1/responses", cut),
        ("POST", "http://d1:1/v1/responses", ask),
    ]
    message = {"model": "m", "max_tokens": 9, "messages": [], "system": "s", "stream": True}
    sent.clear()
    client.post("/v1/messages", json=message)
    cut = {"model": "m", "max_tokens": 1, "messages": [], "system": "s"}
    assert [(url, body) for _, url, body in sent] == [
        ("http://p:1/v1/messages", cut),
        ("http://d2:1/v1/messages", message),
    ]
    sent.clear()
    answer = client.post("/v1/responses", json={"input": "more", "previous_response_id": "resp_1"})
    assert answer.json() == {"host": "d2"}  # d1's turn, but d2 stores resp_1
    assert [url for _, url, _ in sent] == [
        "http://d1:1/v1/responses/resp_1",
        "http://d2:1/v1/responses/resp_1",
        "http://d2:1/v1/responses",
    ]
    sent.clear()
    assert client.get("/v1/responses/resp_1").status_code == 200
    assert client.delete("/v1/responses/resp_1").status_code == 200
    assert sent[-1][:2] == ("DELETE", "http://d2:1/v1/responses/resp_1")
    assert client.get("/stats").json() == {
        "requests": 3,
        "prefill_failures": 0,
        "prefill_skipped": 1,
    }


def test_the_proxy_names_each_requests_decode_instance_in_its_prefill_request():
    """In this process, the instances mocked: with ``--decode-kv-listen``, the prefill request
    of a completion, chat, Responses or Messages request carries ``kv_transfer_params`` naming
    the listener of the decode instance that then gets the request (instances taking turns);
    a proxy without the flag sends none."""
    from fastapi.testclient import TestClient

    from pyxllm.entrypoints.disagg_proxy import DisaggProxy, build_proxy_app

    sent = []

    def instance(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, json.loads(request.content)))
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"))

    def run(decode_kv):
        proxy = DisaggProxy(["http://p:1"], ["http://d1:1", "http://d2:1"], 5, decode_kv)
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(instance))
        client = TestClient(build_proxy_app(proxy))
        sent.clear()
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5})
        client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 5})
        client.post("/v1/messages", json={"messages": [], "max_tokens": 5})
        client.post("/v1/responses", json={"input": "a", "max_output_tokens": 5})
        return [(host, body.get("kv_transfer_params")) for host, body in sent]

    def named(host: str, port: int) -> dict:
        return {"do_remote_decode": True, "remote_host": host, "remote_port": port}

    assert run(["10.0.0.1:8300", "[::1]:8301"]) == [
        ("p", named("10.0.0.1", 8300)),
        ("d1", None),
        ("p", named("::1", 8301)),
        ("d2", None),
        ("p", named("10.0.0.1", 8300)),
        ("d1", None),
        ("p", named("::1", 8301)),
        ("d2", None),
    ]
    assert [params for _, params in run(None)] == [None] * 8
    with pytest.raises(ValueError, match="one for each --decode"):
        DisaggProxy(["http://p:1"], ["http://d1:1", "http://d2:1"], 5, ["h:1"])


def test_a_responses_or_messages_request_pushes_its_kv_to_its_decode_instance_only(
    disaggregated, peers
):
    """The module's prefill instance also pushes to two recording stand-ins of decode
    instances; a proxy (in this process) given their listeners (``--decode-kv-listen``) sends
    a Responses request to the first and a Messages request to the second, naming each in the
    prefill request's ``kv_transfer_params``: each stand-in gets the blocks of its own
    request's prompt only (without the name, both would get both), and the whole request."""
    from fastapi.testclient import TestClient

    from pyxllm.entrypoints.disagg_proxy import DisaggProxy, build_proxy_app

    _, prefill, _ = disaggregated
    addresses = [peer.address for peer in peers]
    proxy = DisaggProxy([prefill.url_for("")], [f"http://{a}" for a in addresses], 120, addresses)
    model = httpx.get(prefill.url_for("v1", "models")).json()["data"][0]["id"]
    ask = {"input": "Name three trees. " * 8, "max_output_tokens": 6, "temperature": 0}
    rivers = [{"role": "user", "content": "Name three rivers. " * 8}]
    message = {"model": model, "max_tokens": 6, "messages": rivers}

    def pushed() -> list[int]:
        return [len(peer.blocks) for peer in peers]

    with TestClient(build_proxy_app(proxy)) as client:
        start = pushed()
        assert client.post("/v1/responses", json=ask).status_code == 200
        first = pushed()
        assert client.post("/v1/messages", json=message).status_code == 200
        second = pushed()
    assert first[0] > start[0] and first[1] == start[1]
    assert second[0] == first[0] and second[1] > first[1]
    assert [peer.posts[-1] for peer in peers] == [("/v1/responses", ask), ("/v1/messages", message)]


def test_without_its_prefill_instance_the_decode_instance_computes_the_prompt(
    disaggregated, offline
):
    """Comes last: it kills the prefill instance."""
    proxy, prefill, decode = disaggregated
    failures = httpx.get(proxy.url_for("stats")).json()["prefill_failures"]
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(timeout=10)
    prompt = [t + 3 for t in PROMPT]
    answer = complete(proxy, prompt)
    assert answer["choices"][0]["text"] == greedy(offline, [prompt])[0]
    assert cached_tokens(answer) == 0
    assert httpx.get(proxy.url_for("stats")).json()["prefill_failures"] == failures + 1
    assert httpx.get(proxy.url_for("health")).status_code == 503


def signed_headers(secret: str, path: str, body: bytes, timestamp: float | None = None) -> dict:
    """A push's signature headers, written here from the documented recipe (not with
    ``kv_transfer.sign``): HMAC-SHA256 keyed by the secret over the method, path, the body's
    SHA-256 and the timestamp, one line each."""
    stamp = str(int(time.time() if timestamp is None else timestamp))
    message = f"PUT\n{path}\n{hashlib.sha256(body).hexdigest()}\n{stamp}".encode()
    signature = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return {"X-KV-Timestamp": stamp, "X-KV-Signature": signature}


def test_kv_moves_over_tcp_between_instances_without_a_shared_directory(
    model_dir, tmp_path, offline, monkeypatch, caplog
):
    """``--kv-transfer-push`` and ``--kv-transfer-listen``: a prefill engine and a decode
    engine (in this process) on directories of their own, sharing a secret; the prefill engine
    pushes its prompt's full blocks, which the decode engine reads as tier hits, answering the
    colocated greedy tokens; a push without the secret, or a foreign or torn one, is refused;
    with the listener closed the prefill engine still answers and the decode engine computes
    the prompt itself."""
    from pyxllm import LLM, SamplingParams
    from pyxllm.engine.kv_transfer import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    caplog.set_level(logging.INFO, logger="pyxllm.engine.kv_connector")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    common = {"model": model_dir, "max_model_len": 256, "kv_cache_memory": 0.05}
    decode_dir, prefill_dir = tmp_path / "decode", tmp_path / "prefill"
    decode = LLM(
        **common, kv_offload_dir=str(decode_dir), kv_role="decode", kv_transfer_listen=address
    )
    prefill = LLM(
        **common, kv_offload_dir=str(prefill_dir), kv_role="prefill", kv_transfer_push=(address,)
    )
    one, six = (SamplingParams(temperature=0, max_tokens=n) for n in (1, 6))
    # each start-up log says where blocks go or come in, and whether a secret guards them
    signed = f"with the secret of ${TOKEN_ENV}"
    assert f"receiving blocks on port {address.split(':')[1]}, {signed}" in caplog.text
    assert f"pushing blocks to {address}, {signed}" in caplog.text
    try:
        listener = decode.llm_engine.kv_connector.listener
        transfer = prefill.llm_engine.kv_connector.transfer
        prompt = {"prompt_token_ids": [t + 4 for t in PROMPT]}
        prefill.generate([prompt], one)
        assert (transfer.pushed, listener.received) == (6, 6)
        [answer] = decode.generate([prompt], six)
        assert answer.outputs[0].text == greedy(offline, [prompt["prompt_token_ids"]])[0]
        assert answer.num_cached_tokens == 6 * BLOCK
        assert len(list(decode_dir.glob("*/*/*.kv"))) == 6
        assert len(list(prefill_dir.glob("*/*/*.kv"))) == 6

        def put(digest: str, body: bytes, checksum: str, token: str | None = "s3cret") -> int:
            connection = http.client.HTTPConnection(*address.split(":"), timeout=10)
            path, headers = f"/kv/{digest}/{'ab' * 32}", {"X-Content-SHA256": checksum}
            if token is not None:
                headers.update(signed_headers(token, path, body))
            connection.request("PUT", path, body=body, headers=headers)
            status = connection.getresponse().status
            connection.close()
            return status

        payload, digest = bytes(listener.tier.block_bytes), listener.tier.root.name
        sha = hashlib.sha256(payload).hexdigest()
        assert put(digest, payload, sha, token=None) == 401  # not signed
        assert put(digest, payload, sha, token="s3cre") == 401  # signed with another secret
        assert put("0" * len(digest), payload, sha) == 409  # another model's blocks
        assert put(digest, payload[:-1], hashlib.sha256(payload[:-1]).hexdigest()) == 400
        assert put(digest, payload, "0" * 64) == 400
        assert (listener.refused, listener.received) == (5, 6)
        assert len(list(decode_dir.glob("*/*/*.kv"))) == 6

        listener.close()
        again = {"prompt_token_ids": [t + 5 for t in PROMPT]}
        prefill.generate([again], one)
        assert transfer.failed == 1
        [answer] = decode.generate([again], six)
        assert answer.outputs[0].text == greedy(offline, [again["prompt_token_ids"]])[0]
        assert answer.num_cached_tokens == 0
    finally:
        prefill.llm_engine.shutdown()
        decode.llm_engine.shutdown()


def test_a_request_naming_its_decode_instance_pushes_its_blocks_there_only(
    model_dir, tmp_path, offline
):
    """A prefill engine pushing to two decode engines (in this process): a request whose
    ``kv_transfer_params`` names one's listener goes there only, and that decode engine reads
    its blocks while the other computes the prompt, both answering the colocated tokens; a
    request naming none, or an address the prefill engine does not push to, goes to both."""
    from pyxllm import LLM, SamplingParams

    addresses = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            addresses.append(f"127.0.0.1:{probe.getsockname()[1]}")
    common = {"model": model_dir, "max_model_len": 256, "kv_cache_memory": 0.05}
    decodes = [
        LLM(
            **common,
            kv_offload_dir=str(tmp_path / f"decode{i}"),
            kv_role="decode",
            kv_transfer_listen=address,
        )
        for i, address in enumerate(addresses)
    ]
    prefill = LLM(
        **common,
        kv_offload_dir=str(tmp_path / "prefill"),
        kv_role="prefill",
        kv_transfer_push=tuple(addresses),
    )
    try:
        listeners = [decode.llm_engine.kv_connector.listener for decode in decodes]

        def prefill_to(prompt: list[int], params: dict | None) -> list[int]:
            """Prefill ``prompt`` with ``kv_transfer_params``; the blocks each decode engine
            received since."""
            before = [listener.received for listener in listeners]
            extra = None if params is None else {"kv_transfer_params": params}
            one = SamplingParams(temperature=0, max_tokens=1, extra_args=extra)
            prefill.generate([{"prompt_token_ids": prompt}], one)
            return [listener.received - b for listener, b in zip(listeners, before)]

        host, port = addresses[1].split(":")
        prompt = [t + 9 for t in PROMPT]
        to_second = {"do_remote_decode": True, "remote_host": host, "remote_port": int(port)}
        assert prefill_to(prompt, to_second) == [0, 6]
        six = SamplingParams(temperature=0, max_tokens=6)
        expected = greedy(offline, [prompt])[0]
        answers = [decode.generate([{"prompt_token_ids": prompt}], six)[0] for decode in decodes]
        assert [a.outputs[0].text for a in answers] == [expected, expected]
        assert [a.num_cached_tokens for a in answers] == [0, 6 * BLOCK]
        assert prefill_to([t + 10 for t in PROMPT], None) == [6, 6]
        elsewhere = {"remote_host": "127.0.0.2", "remote_port": 1}
        assert prefill_to([t + 11 for t in PROMPT], elsewhere) == [6, 6]
    finally:
        for llm in (prefill, *decodes):
            llm.llm_engine.shutdown()


def test_a_listener_that_never_answers_does_not_stall_the_prefill_instance(
    model_dir, tmp_path, offline, monkeypatch
):
    """A peer that takes the connection but never answers: the prefill engine's steps go on
    (pushes wait on a sender thread, not the step), its answers leave once held
    ``HOLD_S``, and the blocks that do not fit the peer's queue are dropped and counted in
    ``/metrics``; nothing is acknowledged."""
    import time

    from prometheus_client import generate_latest

    from pyxllm import LLM
    from pyxllm.engine import kv_transfer

    monkeypatch.setattr(kv_transfer, "PUSH_TIMEOUT", 120.0)
    monkeypatch.setattr(kv_transfer, "HOLD_S", 0.5)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)  # connections wait in the backlog: never accepted, never answered
    prefill = LLM(
        model=model_dir,
        max_model_len=256,
        kv_cache_memory=0.05,
        kv_offload_dir=str(tmp_path),
        kv_role="prefill",
        kv_transfer_push=(f"127.0.0.1:{stalled.getsockname()[1]}",),
    )
    try:
        transfer = prefill.llm_engine.kv_connector.transfer
        block_bytes = prefill.llm_engine.kv_connector.tier.block_bytes
        monkeypatch.setattr(kv_transfer, "MAX_QUEUED_BYTES", 2 * block_bytes)
        prompts = [[t + k for t in PROMPT] for k in (6, 7, 8)]  # 6 full blocks each
        start = time.monotonic()
        answers = greedy(prefill, prompts, max_tokens=1)
        assert time.monotonic() - start < 60  # half PUSH_TIMEOUT: no step waited for it
        assert answers == greedy(offline, prompts, max_tokens=1)
        # the first block is under way (stuck), the next one queued, the other 16 dropped
        assert (transfer.pushed, transfer.failed, transfer.dropped) == (0, 0, 16)
        text = generate_latest(prefill.llm_engine.metrics.registry).decode()
        samples = {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "pyxllm:kv_transfer_blocks_total"
        }
        assert samples == {"pushed": 0, "failed": 0, "dropped": 16}
    finally:
        prefill.llm_engine.shutdown()
        stalled.close()


def test_a_pusher_opens_a_new_connection_after_a_refusal(tmp_path):
    """In this process, no model: the listener closes the connection of a refused push, so the
    pusher's next push (its secret right now, the retry time over) goes on a new connection
    and is taken at once, not failed once more on the closed one."""
    from pyxllm.engine.kv_offload import DiskKVTier
    from pyxllm.engine.kv_transfer import KVTransferClient, KVTransferServer

    tier = DiskKVTier(str(tmp_path / "decode"), 2**20, "tiny", 64)
    server = KVTransferServer(tier, "127.0.0.1:0", "s3cret")
    client = KVTransferClient([f"127.0.0.1:{server.port}"], tier.root.name, "other")
    client.push(b"a" * 32, bytes(64))
    client._secret, client.peers[0].down_until = b"s3cret", 0.0
    client.push(b"b" * 32, bytes(64))
    client.close()
    server.close()
    assert (client.failed, client.pushed) == (1, 1) and tier.contains(b"b" * 32)


def test_a_push_without_the_listeners_secret_is_refused_and_not_stored(tmp_path, caplog):
    """In this process, no model: a listener with a secret takes the block of a pusher that
    signs with it, and refuses (401, logged) and stores nothing of one signing with another
    secret or not at all; the secret itself is never on the wire; a signature over another
    block, or a timestamp outside the window, is refused, and a replay inside the window
    rewrites the same block only; a listener without a secret takes any push."""
    import socketserver

    from pyxllm.engine.kv_offload import DiskKVTier
    from pyxllm.engine.kv_transfer import KVTransferClient, KVTransferServer

    tier = DiskKVTier(str(tmp_path / "decode"), 2**20, "tiny", 64)
    payload, digest = bytes(range(64)), tier.root.name
    servers = [KVTransferServer(tier, "127.0.0.1:0", token) for token in ("s3cret", None)]
    # what a pusher sends, as a recorder on the wire sees it
    wire: list[bytes] = []

    class Record(socketserver.BaseRequestHandler):
        def handle(self):
            data = b""
            while len(data) < 64 or b"\r\n\r\n" not in data:
                chunk = self.request.recv(65536)
                if not chunk:
                    break
                data += chunk
            wire.append(data)
            self.request.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")

    recorder = socketserver.TCPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{servers[0].port}"
        for token, block in ((None, b"a"), ("other", b"b"), ("s3cret", b"c")):
            client = KVTransferClient([address], digest, token)
            client.push(block * 32, payload)
            client.close()
            assert (client.pushed, client.failed) == ((1, 0) if token == "s3cret" else (0, 1))
        assert (servers[0].refused, servers[0].received) == (2, 1)
        assert [tier.contains(b * 32) for b in (b"a", b"b", b"c")] == [False, False, True]
        assert caplog.text.count("HTTP 401 (no signature)") == 1
        assert caplog.text.count("HTTP 401 (a wrong signature)") == 1

        client = KVTransferClient([f"127.0.0.1:{recorder.server_address[1]}"], digest, "s3cret")
        client.push(b"c" * 32, payload)
        client.close()
        [request] = wire
        assert b"s3cret" not in request and b"Authorization" not in request
        path = f"/kv/{digest}/{(b'c' * 32).hex()}"
        head = dict(
            line.split(": ", 1) for line in request.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
        )
        assert head["X-KV-Signature"] == signed_headers("s3cret", path, payload)["X-KV-Signature"]

        def put(block: bytes, body: bytes, headers: dict) -> int:
            connection = http.client.HTTPConnection("127.0.0.1", servers[0].port, timeout=10)
            headers = {"X-Content-SHA256": hashlib.sha256(body).hexdigest(), **headers}
            connection.request("PUT", f"/kv/{digest}/{block.hex()}", body=body, headers=headers)
            status = connection.getresponse().status
            connection.close()
            return status

        # the recorded push replayed: the same block written again, nothing else
        replay = {k: head[k] for k in ("X-KV-Timestamp", "X-KV-Signature")}
        files = sorted(tier.root.glob("*/*.kv"))
        assert put(b"c" * 32, payload, replay) == 204
        assert sorted(tier.root.glob("*/*.kv")) == files
        # its signature does not cover another block's path or another body
        assert put(b"e" * 32, payload, replay) == 401
        assert put(b"c" * 32, bytes(64), replay) == 401
        # a timestamp 61 s off, signed with the right secret
        e_path = f"/kv/{digest}/{(b'e' * 32).hex()}"
        for skew in (-61, 61):
            stale = signed_headers("s3cret", e_path, payload, time.time() + skew)
            assert put(b"e" * 32, payload, stale) == 401
        assert put(b"e" * 32, payload, {**replay, "X-KV-Timestamp": "nan"}) == 401
        assert put(b"e" * 32, payload, signed_headers("s3cret", e_path, payload)) == 204
        assert caplog.text.count("HTTP 401 (a timestamp outside the 60 s window)") == 3
        assert (servers[0].refused, servers[0].received) == (7, 3)

        client = KVTransferClient([f"127.0.0.1:{servers[1].port}"], digest, "any")
        client.push(b"d" * 32, payload)
        client.close()
        assert client.pushed == 1 and tier.contains(b"d" * 32)
    finally:
        recorder.shutdown()
        recorder.server_close()
        for server in servers:
            server.close()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_transfer_push": ("127.0.0.1:9000",)}, "--kv-transfer-push: needs --kv-offload-dir"),
        ({"kv_transfer_listen": "9000"}, "--kv-transfer-listen '9000': must be HOST:PORT"),
        ({"kv_transfer_push": ("h:70000",)}, "--kv-transfer-push 'h:70000': must be HOST:PORT"),
        ({"kv_offload_dir": "d", "kv_role": "decode", "kv_transfer_push": ("h:1",)}, "not with"),
        ({"kv_transfer_listen": "ray://"}, "--kv-transfer-listen 'ray://': must be ray://NAME"),
        ({"kv_transfer_push": ("ray://a b",)}, "--kv-transfer-push 'ray://a b': must be ray://"),
        ({"kv_transfer_push": ("ray://kv",)}, "--kv-transfer-push: needs --kv-offload-dir"),
        ({"kv_offload_dir": "d", "kv_transfer_push": ("ray://kv", "h:1")}, "give it alone"),
        ({"ray_address": "h:1"}, "--ray-address: applies to --distributed-executor-backend ray"),
    ],
)
def test_the_transfer_flags_are_checked(fields, message):
    from pyxllm.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model="m", **fields)


def test_a_ray_transfer_takes_the_ray_address_and_needs_ray(monkeypatch):
    import sys

    from pyxllm.config import EngineConfig

    config = EngineConfig(
        model="m",
        kv_offload_dir="d",
        kv_role="decode",
        kv_transfer_listen="ray://kv-1.a_b",
        ray_address="10.0.0.1:6379",
    )
    assert (config.ray_kv_transfer, config.ray_address) == (True, "10.0.0.1:6379")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(ValueError, match=r"ray://: Ray is not installed here; .venv/bin/pip"):
        EngineConfig(model="m", kv_offload_dir="d", kv_transfer_push=("ray://kv",))
