"""``pyxllm run-batch``: each result line's body is what a live ``pyxllm serve`` answers for the
same body, bad lines get error lines without stopping the run, and a rerun sends only the
lines not yet in the output."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI, Request

from pyxllm.entrypoints.openai.run_batch import (
    BatchDone,
    BatchLineError,
    parse_batch_line,
    read_done,
    run_batch,
)
from tests.utils import RemoteServer

MODEL = "smollm2-batch"
ENGINE_ARGS = ["--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "0.25"]


def line(custom_id, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize(
    "text, code",
    [
        ("{not json", "invalid_json_line"),
        ("[1, 2]", "invalid_json_line"),
        (json.dumps({"url": "/v1/completions", "body": {}}), "missing_required_parameter"),
        (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/models"}), "invalid_value"),
        (line("a", "/v1/responses", input="hi"), "invalid_url"),
        (json.dumps({"custom_id": "a", "url": "/v1/completions"}), "missing_required_parameter"),
        (line("a", prompt="hi", stream=True), "invalid_value"),
    ],
)
def test_a_line_that_cannot_be_sent_names_why(text, code):
    with pytest.raises(BatchLineError) as caught:
        parse_batch_line(text)
    assert caught.value.code == code


def test_read_done_drops_a_cut_line_and_refuses_a_file_not_its_own(tmp_path):
    path = tmp_path / "out.jsonl"
    answered = {"custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    failed = {"custom_id": None, "response": None, "error": {"code": "x", "line": 3}}
    path.write_text(json.dumps(answered) + "\n" + json.dumps(failed) + '\n{"custom_id": "b", "re')
    done = read_done(str(path))
    assert (done.custom_ids, done.lines) == ({"a"}, {3})
    assert path.read_text().count("\n") == 2 and path.read_text().endswith("\n")
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="line 1 is not a result line"):
        read_done(str(path))


def _echo_app() -> tuple[FastAPI, dict]:
    """An app answering /v1/completions with its body after a short wait, recording the
    prompts it got and the most requests in flight at once."""
    app, seen = FastAPI(), {"prompts": [], "in_flight": 0, "most": 0}

    @app.post("/v1/completions")
    async def complete(request: Request) -> dict:
        body = await request.json()
        seen["in_flight"] += 1
        seen["most"] = max(seen["most"], seen["in_flight"])
        await asyncio.sleep(0.05)
        seen["in_flight"] -= 1
        seen["prompts"].append(body["prompt"])
        return {"echo": body}

    return app, seen


def test_a_rerun_sends_only_the_lines_not_in_the_output(tmp_path):
    lines = [line(f"q{i}", prompt=f"p{i}") for i in range(8)] + ["{oops", line("q0", prompt="x")]
    first, seen = _echo_app()
    out = io.StringIO()
    counts = asyncio.run(run_batch(first, lines, out, max_concurrency=3))
    assert (counts.answered, counts.failed, counts.skipped) == (8, 2, 0)
    assert sorted(seen["prompts"]) == [f"p{i}" for i in range(8)] and seen["most"] == 3
    results = [json.loads(text) for text in out.getvalue().splitlines()]
    errors = {r["error"]["line"]: r["error"]["code"] for r in results if r["error"]}
    assert errors == {9: "invalid_json_line", 10: "duplicate_custom_id"}
    for result in results:
        if result["response"] is not None:
            number = int(result["custom_id"][1:])
            assert result["response"]["body"] == {"echo": {"prompt": f"p{number}"}}

    # a stopped run: half the answers written, then a line cut short
    path = tmp_path / "out.jsonl"
    kept = [r for r in results if r["custom_id"] in ("q1", "q4", "q6") or r["error"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": "batch_req_1", "cus')
    second, seen = _echo_app()
    done = read_done(str(path))
    assert isinstance(done, BatchDone) and len(done) == 5
    with open(path, "a") as file:
        counts = asyncio.run(run_batch(second, lines, file, max_concurrency=2, done=done))
    assert (counts.answered, counts.failed, counts.skipped) == (5, 0, 5)
    assert sorted(seen["prompts"]) == ["p0", "p2", "p3", "p5", "p7"]
    final = [json.loads(text) for text in path.read_text().splitlines()]
    ids = sorted(r["custom_id"] for r in final if r["response"])
    assert ids == [f"q{i}" for i in range(8)] and len(final) == 10


def assert_same_answer(got, expected, where: str) -> None:
    """``got`` equals ``expected`` but for ids and timestamps, and logprobs within float32
    rounding: a batch's requests run side by side, the server's one at a time, and float
    matmuls may round a row differently in a bigger batch (the tokens are the same)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key in expected.keys() - {"id", "created"}:
            assert_same_answer(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for i, (item, wanted) in enumerate(zip(got, expected)):
            assert_same_answer(item, wanted, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5), where
    else:
        assert got == expected, where


def test_each_result_is_what_the_server_answers(tmp_path):
    """The run and the server load the model at the same time; the server then answers each
    body that was sent."""
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    bodies = {
        "chat": ("/v1/chat/completions", {"model": MODEL, **chat, "max_tokens": 6}),
        "chat-logprobs": (
            "/v1/chat/completions",
            {"model": MODEL, **chat, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
        ),
        "text": ("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 6}),
        "text-n": (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "One, two,",
                "max_tokens": 5,
                "n": 2,
                "seed": 7,
                "temperature": 0.8,
            },
        ),
        "bad-field": ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}),
        "bad-model": ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
    }
    for _, body in bodies.values():
        body.setdefault("temperature", 0)
    lines = [line(custom_id, url, **body) for custom_id, (url, body) in bodies.items()]
    lines += [line("chat", prompt="again"), line("s", prompt="x", stream=True), ""]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "pyxllm", "run-batch", *ENGINE_ARGS]
    run = subprocess.Popen(
        [*command, "-i", str(source), "-o", str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with RemoteServer(ENGINE_ARGS) as server:
        expected = {
            custom_id: httpx.post(server.url_for(url), json=body, timeout=60)
            for custom_id, (url, body) in bodies.items()
        }
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr[-4000:]
    assert "6 answered, 2 not sent (error lines), 0 skipped" in stderr
    results = [json.loads(text) for text in target.read_text().splitlines()]
    answered = {r["custom_id"]: r["response"] for r in results if r["response"]}
    assert answered.keys() == bodies.keys()
    for custom_id, response in expected.items():
        got = answered[custom_id]
        assert got["status_code"] == response.status_code, custom_id
        assert_same_answer(got["body"], response.json(), custom_id)
    assert answered["chat"]["body"]["choices"][0]["message"]["content"]  # real text
    errors = sorted((r["error"]["line"], r["error"]["code"]) for r in results if r["error"])
    assert errors == [(7, "duplicate_custom_id"), (8, "invalid_value")]
