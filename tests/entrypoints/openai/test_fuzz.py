"""A seeded fuzz of ``pyxllm serve``: 1,000 generated requests over every route and field, 200
more to the Responses API (:mod:`tests.fuzz.responses`), 100 to Anthropic's Messages API and its
token count (:mod:`tests.fuzz.messages`), then ``n`` far above its bound, and stored responses
created, retrieved, chained on and deleted, asserting that the server never fails.

The corpus (:mod:`tests.fuzz`, which says which fault must get which answer) holds
valid requests in random combinations (``n`` with ``stream``, ``logprobs`` with ``echo``, stop
lists, ``logit_bias``, seeds, structured outputs and tools) and faulty ones: wrong types,
out-of-range and extreme numbers (``1e308``, ``-0``, ``2**64``, 5000-digit integers, NaN),
lone surrogates as JSON escapes and as raw invalid UTF-8, empty and huge strings, deep nesting,
too many messages, stop strings or ``logit_bias`` entries, request chat templates, bodies over the
size limit, wrong content types, invalid JSON, unknown routes and wrong methods; to the Messages
API also image blocks, thinking budgets, refused fields and a last turn of the assistant. Every
request is cheap (``max_tokens`` 1-4, ``n`` at most 3, short prompts); they go 12 at a time over
keep-alive connections, then the ``n`` far above the bound one at a time (a server without the
bound may hang on them, so they come last).

Asserted for every answer: no 5xx and no dropped connection; the status the corpus expects;
every 4xx in OpenAI's error shape, naming the ``param`` the corpus expects (on Anthropic's routes
in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, the message naming the
field); a 200 well formed (strict JSON without NaN or Infinity, a stream ending with
``data: [DONE]`` and no error event, one finish reason per choice, finite logprobs; the greedy
text where the request keeps only the top token; a Messages answer's content blocks, stop reason
and usage, its stream's events from ``message_start`` to ``message_stop``). At the end
``/health`` is 200 and ``/debug/stats`` shows nothing running or waiting and no KV block used.

The server runs a tiny random Llama checkpoint (two layers, hidden size 64, the SmolLM2
tokenizer and chat template, built in a temporary directory): what is fuzzed is the server's
handling of requests, not the model's text, and on the 135M default model the corpus's ~400
generations took ~40 s of the test's ~60 s (1,300 requests in ~15 s on the tiny one).

Reproducing: the seed is printed (``PYXLLM_FUZZ_SEED`` overrides the default); a failure lists
each failed case's id, request and a Python line resending it; ``PYXLLM_FUZZ_CASES=3,17`` runs only
those cases of that seed. ``PYXLLM_FUZZ_COUNT`` changes the corpus size and
``PYXLLM_FUZZ_REPORT=path.json`` writes every failure there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.fuzz.cases import bad, bound_cases, generate_cases, select_cases
from tests.fuzz.checks import check_case
from tests.fuzz.clients import (
    compute_references,
    is_idle,
    run_cases,
    server_tracebacks,
    summarize,
    wait_idle,
)
from tests.fuzz.messages import MESSAGES_PATH, check_messages_200, messages_case, messages_cases
from tests.fuzz.responses import check_stored_round_trip, responses_cases
from tests.model_fixtures import build_hf_model, tiny_config
from tests.utils import RemoteServer

SEED = int(os.environ.get("PYXLLM_FUZZ_SEED", "15"))
COUNT = int(os.environ.get("PYXLLM_FUZZ_COUNT", "1000"))  # the issue asks for >= 1,000
RESPONSES_COUNT = COUNT // 5  # the Responses API's cases, on top
MESSAGES_COUNT = COUNT // 10  # Anthropic's Messages API's, on top
ONLY = os.environ.get("PYXLLM_FUZZ_CASES", "")
REPORT = os.environ.get("PYXLLM_FUZZ_REPORT", "")
CONCURRENCY = 12
# A correct server answers the whole corpus in well under a minute here; past this budget the
# rest is reported as not sent (a hung server must not hang the suite).
BUDGET_S = 240.0
BOUND_TIMEOUT_S = 20.0
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.25"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_gguf_path) -> list[str]:
    """The server's model flags: a tiny random Llama saved in a temporary directory, with the
    default model's tokenizer and chat template (``--tokenizer``)."""
    directory = tmp_path_factory.mktemp("fuzz") / "tiny-llama"
    model = build_hf_model(tiny_config("llama", max_position_embeddings=2048))
    model.save_pretrained(directory)
    return ["--model", str(directory), "--tokenizer", str(default_gguf_path)]


def test_fuzz_never_fails_the_server(tiny_model):
    with RemoteServer([*tiny_model, *SERVER_ARGS]) as server:
        base = f"http://{server.host}:{server.port}"
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        corpus = (
            generate_cases(SEED, COUNT, model)
            + responses_cases(SEED, RESPONSES_COUNT, model)
            + messages_cases(SEED, MESSAGES_COUNT, model)
        )
        cases = select_cases(corpus, ONLY)
        bounds = select_cases(bound_cases(model), ONLY)
        assert ONLY or len(cases) >= 1000
        print(f"fuzz seed {SEED} (PYXLLM_FUZZ_SEED): {len(cases)} requests, {len(bounds)} bounds")

        references = asyncio.run(compute_references(base, cases))
        start = time.monotonic()
        results = asyncio.run(
            run_cases(
                base,
                cases,
                concurrency=CONCURRENCY,
                references=references,
                deadline=start + BUDGET_S,
            )
        )
        corpus_s = time.monotonic() - start
        # one at a time, in rising n: after one gets no answer the server is lost, skip the rest
        lost = False
        for case in bounds:
            deadline = 0.0 if lost else None
            [result] = asyncio.run(
                run_cases(
                    base,
                    [case],
                    1,
                    timeout=BOUND_TIMEOUT_S,
                    deadline=deadline,
                    skip_reason="the server did not answer a smaller n",
                )
            )
            lost = lost or result.status is None
            results.append(result)
        print(
            f"{len(results)} requests in {time.monotonic() - start:.1f} s ({corpus_s:.1f} s corpus)"
        )

        stored = [] if ONLY else check_stored_round_trip(base, model, SEED)
        try:
            health = httpx.get(base + "/health", timeout=10).status_code
        except httpx.HTTPError as exc:
            health = repr(exc)
        stats = wait_idle(base, timeout=15.0)
        failed = [r for r in results if r.problems]
        if REPORT:
            with open(REPORT, "w") as out:
                rows = [
                    {
                        "id": r.case.id,
                        "label": r.case.label,
                        "request": r.case.describe(2000),
                        "expect": r.case.expect.describe(),
                        "status": r.status,
                        "problems": r.problems,
                        "repro": r.case.repro(base),
                    }
                    for r in failed
                ]
                json.dump({"seed": SEED, "failures": rows}, out, indent=1)
        log = server.output()

    report = [f"seed {SEED}: /health {health}, /debug/stats {stats}"]
    if stored:
        report.append("stored responses (create, retrieve, chain, delete):\n" + "\n".join(stored))
    if failed:
        report.append(summarize(results, SEED, base)[:24000])
    tracebacks = server_tracebacks(log)
    if tracebacks:
        text = "\n---\n".join(tracebacks)
        report.append(f"server tracebacks (last, distinct; pyxllm frames):\n{text[-8000:]}")
    message = "\n".join(report)
    served = not failed and not stored and health == 200 and is_idle(stats)
    assert served, message


def _anthropic_error(error_type: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": error_type, "message": message}}).encode()


def _sse(events: list[dict]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def test_the_messages_judges_refuse_what_a_correct_server_does_not_answer():
    """The Messages cases' judges (no server): an error in OpenAI's shape, of the wrong type or
    naming another field, a message with an unknown stop reason or block, a stream cut before
    ``message_stop``, with a delta of the wrong type or an error event, each fail the case."""
    request = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    fault = messages_case(1, "fault", MESSAGES_PATH, request, bad("max_tokens"))
    json_headers = httpx.Headers({"content-type": "application/json"})
    named = _anthropic_error("invalid_request_error", "max_tokens: Field required")
    assert check_case(fault, 400, json_headers, named, None) == []
    openai_shape = {"error": {"message": "max_tokens: x", "type": "BadRequestError"}}
    for body in (
        json.dumps({**openai_shape, "param": "max_tokens", "code": 400}).encode(),
        _anthropic_error("not_found_error", "max_tokens: Field required"),
        _anthropic_error("invalid_request_error", "temperature: Field required"),
        _anthropic_error("invalid_request_error", "max_tokens_x: Field required"),
    ):
        assert check_case(fault, 400, json_headers, body, None), body

    usage = {
        "input_tokens": 3,
        "output_tokens": 2,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "model": "m",
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": usage,
    }
    valid = messages_case(2, "valid", MESSAGES_PATH, request)
    assert check_messages_200(valid, json_headers, json.dumps(message).encode()) == []
    for change in (
        {"stop_reason": "length"},
        {"stop_reason": "stop_sequence", "stop_sequence": "."},
        {"content": [{"type": "image"}]},
        {"content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"usage": {**usage, "output_tokens": 1}},
    ):
        body = json.dumps({**message, **change}).encode()
        assert check_messages_200(valid, json_headers, body), change

    streamed = messages_case(3, "streamed", MESSAGES_PATH, {**request, "stream": True})
    sse_headers = httpx.Headers({"content-type": "text/event-stream"})
    start = {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}}
    text = {"type": "text", "text": ""}
    delta = {"type": "text_delta", "text": "Hi"}
    events = [
        start,
        {"type": "content_block_start", "index": 0, "content_block": text},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage},
        {"type": "message_stop"},
    ]
    assert check_messages_200(streamed, sse_headers, _sse(events)) == []
    wrong_delta = {"type": "input_json_delta", "partial_json": "{"}
    error = {"type": "error", "error": {"type": "api_error", "message": "x"}}
    for broken in (
        events[:-1],
        events[:4] + events[5:],
        [*events[:3], {**events[3], "delta": wrong_delta}, *events[4:]],
        [*events[:4], error],
    ):
        assert check_messages_200(streamed, sse_headers, _sse(broken)), broken
