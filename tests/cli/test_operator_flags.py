"""What an operator sets on ``pyxllm serve``, end to end on one real server: several served
names, ``--chat-template`` from a file, ``--generation-config DIR``, ``--root-path``,
``--enable-log-requests`` with ``--max-log-len``, ``usage.prompt_tokens_details.cached_tokens``;
and what fails before the model loads (a busy port), the CPU tensor-parallel warning and the
fused kernels' load messages."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pyxllm.kernels.cpu import build
from pyxllm.platforms import resolve_platform
from pyxllm.platforms.interface import physical_cores
from tests.utils import RemoteServer, free_port

NAMES = ("first-name", "second-name")
ROOT_PATH = "/api"
MAX_LOG_LEN = 40
# a chat template unlike the model's, so its rendering shows in the token ids
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
# --generation-config DIR: these become the request defaults
GENERATION = {"temperature": 0.0, "max_new_tokens": 5}
# a prompt of ~150 tokens that no other test sends, for the prefix-cache figures
LONG_PROMPT = " ".join(f"item{i} is number {i} of the operator list;" for i in range(30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("operator")
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    generation = folder / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text(json.dumps(GENERATION))
    args = [
        *("--served-model-name", *NAMES),
        *("--chat-template", str(template)),
        *("--generation-config", str(generation)),
        *("--root-path", ROOT_PATH),
        "--enable-log-requests",
        *("--max-log-len", str(MAX_LOG_LEN)),
        "--enable-prompt-tokens-details",
        *("--max-model-len", "512", "--kv-cache-memory", "0.1"),
    ]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def stats(server) -> dict:
    return httpx.get(server.url_for("debug", "stats"), timeout=10).json()


def test_every_served_name_is_accepted_and_the_first_reported(server, client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        reply = client.completions.create(model=name, prompt="Hello", max_tokens=1)
        assert reply.model == NAMES[0]
        assert httpx.get(server.url_for("v1", "models", name)).status_code == 200
    with pytest.raises(openai.NotFoundError, match="first-name"):
        client.completions.create(model="third-name", prompt="Hello", max_tokens=1)


def test_the_chat_template_file_renders_the_prompt(server, client):
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(server.url_for("tokenize"), json={"messages": messages}).json()
    text = httpx.post(
        server.url_for("tokenize"),
        json={"prompt": "[user] Hi there\n[assistant] ", "add_special_tokens": False},
    ).json()
    assert chat["tokens"] == text["tokens"]
    reply = client.chat.completions.create(model=NAMES[1], messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == text["count"]


def test_the_generation_config_directory_gives_the_request_defaults(client):
    # temperature 0 and max_new_tokens 5 from the directory: a chat request that sets neither
    # is greedy (two agree) and stops after 5 tokens, or earlier at the end of its text
    messages = [{"role": "user", "content": "Tell me a story."}]
    replies = [client.chat.completions.create(model=NAMES[0], messages=messages) for _ in "ab"]
    for reply in replies:
        ending = (reply.usage.completion_tokens, reply.choices[0].finish_reason)
        assert ending == (5, "length") or (ending[1] == "stop" and ending[0] < 5), ending
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_routes_answer_under_the_root_path_too(server):
    base = f"http://{server.host}:{server.port}"
    for path in ("/v1/models", f"{ROOT_PATH}/v1/models", f"{ROOT_PATH}/health"):
        assert httpx.get(base + path).status_code == 200, path
    reply = httpx.post(
        f"{base}{ROOT_PATH}/v1/completions",
        json={"model": NAMES[0], "prompt": "Hello", "max_tokens": 1},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 1
    assert httpx.get(f"{base}/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]
    assert f"{ROOT_PATH}/openapi.json" in httpx.get(f"{base}/docs").text


def test_each_request_is_logged_at_arrival_and_finish(server, client):
    prompt = "A prompt longer than forty characters, so the log cuts it here."
    reply = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=3, temperature=0)
    request_id = reply.id
    deadline = time.monotonic() + 10
    while f"request {request_id}: finished" not in server.output():
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.05)
    lines = [line for line in server.output().splitlines() if f"request {request_id}:" in line]
    arrival, finish = lines
    assert f"request {request_id}: {reply.usage.prompt_tokens} prompt tokens, " in arrival
    assert "SamplingParams(n=1, temperature=0.0" in arrival and "max_tokens=3" in arrival
    assert arrival.endswith(f"prompt: {prompt[:MAX_LOG_LEN]!r}")
    match = re.search(
        r"finished \((\w+)\), (\d+) output tokens, TTFT ([\d.]+) s, e2e ([\d.]+) s", finish
    )
    assert match is not None, finish
    reason, tokens, ttft, e2e = match.groups()
    assert (reason, int(tokens)) == (reply.choices[0].finish_reason, reply.usage.completion_tokens)
    assert 0 < float(ttft) <= float(e2e)


def test_cached_tokens_are_the_prefix_cache_hit(server, client):
    first = client.completions.create(model=NAMES[0], prompt=LONG_PROMPT, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits = stats(server)["prefix_cache_hits"]
    again = client.completions.create(model=NAMES[0], prompt=LONG_PROMPT, max_tokens=1)
    hit = stats(server)["prefix_cache_hits"] - hits
    n = again.usage.prompt_tokens
    assert hit == (n - 1) // 16 * 16 > 0  # whole blocks, never the last prompt token
    assert again.usage.prompt_tokens_details.cached_tokens == hit
    stream = client.completions.create(
        model=NAMES[0],
        prompt=LONG_PROMPT,
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [hit]
    messages = [{"role": "user", "content": LONG_PROMPT}]
    client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    hits = stats(server)["prefix_cache_hits"]
    chat = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    hit = stats(server)["prefix_cache_hits"] - hits
    assert chat.usage.prompt_tokens_details.cached_tokens == hit > 0


def test_a_busy_port_fails_before_the_model_loads():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pyxllm", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: --port {port}: 127.0.0.1:{port} is already in use" in proc.stderr
    assert "KV blocks" not in proc.stderr  # the engine's first log line: nothing was loaded
    assert time.monotonic() - start < 60


def test_a_loading_server_holds_its_port_and_answers_what_came_meanwhile(tmp_path):
    """The port is listened on before the model loads: a second server started during the
    load fails at once (it used to bind the same port beside the first, print its banner and
    serve nothing), and a request sent during the load is answered once the model is up."""
    port = free_port()
    log = open(tmp_path / "first.log", "w+")  # noqa: SIM115 - read while the server runs
    cmd = [sys.executable, "-m", "pyxllm", "serve", "--port", str(port), "--graph-backend", "eager"]
    first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # connect as soon as the port listens
            try:
                early = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        log.seek(0)
        assert "KV blocks" not in log.read()  # still loading: the engine's first line is absent
        second = subprocess.run(
            [*cmd[:-2], "--served-model-name", "second"], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"error: --port {port}: 127.0.0.1:{port} is already in use" in second.stderr
        early.settimeout(120)
        early.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := early.recv(65536):
            answer += chunk
        early.close()
        assert answer.startswith(b"HTTP/1.1 200") and b"SmolLM2-135M-Instruct" in answer, answer
    finally:
        first.terminate()
        first.wait(timeout=60)
        log.close()


# --- start-up messages (no server) ---------------------------------------------------------


def test_cpu_tensor_parallel_warns_with_more_ranks_than_cores():
    cpu = resolve_platform("cpu")
    cores = physical_cores()
    assert cpu.tp_cores_warning(cores) is None
    warning = cpu.tp_cores_warning(cores + 1)
    assert f"--tensor-parallel-size {cores + 1} on the CPU" in warning
    assert f"share {cores} physical core" in warning


def test_a_stale_build_lock_is_named_and_given_up_on(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(TimeoutError, match=re.escape(str(lock))):
        build.wait_for_build_lock(lock, timeout=600)


def test_a_live_build_lock_is_waited_for_naming_it(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    start = time.monotonic()
    with caplog.at_level("INFO", logger=build.__name__):
        build.wait_for_build_lock(lock, timeout=600, poll=0.05)
    assert time.monotonic() - start >= 0.25
    assert any(str(lock) in record.getMessage() for record in caplog.records)


def test_the_load_message_says_whether_the_kernels_were_built(tmp_path):
    library = tmp_path / "pyxllm_cpu_kernels_x.so"
    library.write_bytes(b"first build")
    before = build.libraries(tmp_path)
    cached = build.load_message(before, build.libraries(tmp_path), 0.2, tmp_path)
    assert cached == f"fused CPU kernels: loaded the cached build in 0.2 s ({tmp_path})"
    later = time.time() + 5
    os.utime(library, (later, later))  # rebuilt (the source or flags changed)
    rebuilt = build.load_message(before, build.libraries(tmp_path), 31.0, tmp_path)
    assert rebuilt == f"fused CPU kernels built in 31.0 s ({tmp_path})"
    first = build.load_message({}, build.libraries(tmp_path), 42.0, tmp_path)
    assert first.startswith("fused CPU kernels built in 42.0 s")


def test_chunked_prefill_off_with_the_default_budget_starts():
    """A new user's ``--no-enable-chunked-prefill`` (the default model: max_model_len 8192)
    used to stop with "2048 is below --max-model-len"; now each step may take a whole prompt."""
    from pyxllm.config import EngineConfig
    from pyxllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(enable_chunked_prefill=False, kv_cache_memory=0.05))
    try:
        assert engine.max_model_len == 8192
        assert engine.scheduler.max_tokens == 8192
    finally:
        engine.shutdown()
