"""The Responses API's share of the fuzz (``tests/entrypoints/openai/test_fuzz.py``): random
``POST /v1/responses`` bodies, valid and faulty, streamed and not, ``GET`` / ``DELETE
/v1/responses/{id}`` of ids that were never stored, and (:func:`check_stored_round_trip`)
responses created, retrieved and deleted in turn.

Cases are :class:`tests.fuzz.cases.Case` with ``kind="responses"``;
:func:`check_responses_200` judges a 200 (strict JSON, ``object: "response"``, a final status,
well-formed output items and usage; a stream of named SSE events with rising sequence numbers
from ``response.created`` to ``response.completed`` or ``response.incomplete``, no error event).
What each fault must name follows the corpus's rules (see :mod:`tests.fuzz`).
"""

from __future__ import annotations

import json
import random

import httpx

from tests.fuzz.cases import (
    DEEP,
    JSON_HEADERS,
    OK,
    PROMPTS,
    WORDS,
    Case,
    Raw,
    any_error,
    bad,
    encode_body,
    nested,
    ok_or_bad,
)
from tests.fuzz.cases import TOOL as CHAT_TOOL
from tests.fuzz.checks import named_events, strict_json

RESPONSES_PATH = "/v1/responses"
FINAL_STATUSES = ("completed", "incomplete")
TOOL = {"type": "function", **CHAT_TOOL["function"]}  # the Responses API's flat shape
FORMATS = [
    {"type": "text"},
    {"type": "json_object"},
    {
        "type": "json_schema",
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "maxLength": 8}},
            "required": ["answer"],
        },
    },
]
# (fields, what a correct server answers): one fault each
FAULTS: list[tuple[dict, object]] = [
    ({"input": 5}, bad("input")),
    ({"input": []}, ok_or_bad("input")),  # with instructions there is a message
    ({"input": None}, ok_or_bad("input")),
    ({"input": [{"role": "user", "content": 5}]}, bad("input")),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, bad("input")),
    ({"input": "\udfff"}, bad("input")),
    ({"input": Raw(b'"\xff"')}, bad("input", null_ok=True)),
    ({"instructions": 5}, bad("instructions")),
    ({"instructions": "a\ud800b"}, bad("instructions")),
    ({"max_output_tokens": 0}, bad("max_output_tokens")),
    ({"max_output_tokens": -3}, bad("max_output_tokens")),
    ({"max_output_tokens": "many"}, bad("max_output_tokens")),
    ({"max_output_tokens": 10**12}, bad("max_output_tokens")),
    ({"max_output_tokens": 2**64}, bad("max_output_tokens")),
    ({"temperature": -1}, bad("temperature")),
    ({"temperature": 1e308}, bad("temperature")),
    ({"temperature": "hot"}, bad("temperature")),
    ({"top_p": 0}, bad("top_p")),
    ({"top_p": 1.5}, bad("top_p")),
    ({"top_logprobs": -1}, bad("top_logprobs")),
    ({"top_logprobs": 10**6}, bad("top_logprobs")),
    ({"stream": "sometimes"}, bad("stream")),
    ({"store": []}, bad("store")),
    ({"model": "other"}, bad("model", statuses=(404,))),
    ({"model": "\udfff"}, bad("model")),
    ({"tools": "x"}, bad("tools")),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, bad("tools")),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, bad("tool_choice")),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, bad("tool_choice")),
    ({"tools": [TOOL]}, OK),  # "auto": the parser the chat template calls for serves it
    ({"text": {"format": {"type": "xml"}}}, bad("text")),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, bad("text")),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, bad("text")),
    ({"previous_response_id": "resp_never_stored"}, bad("previous_response_id", statuses=(404,))),
    ({"previous_response_id": 5}, bad("previous_response_id")),
    ({"background": True}, bad("background")),
    ({"truncation": "auto"}, bad("truncation")),
    ({"service_tier": "flex"}, bad("service_tier")),
    ({"conversation": "conv_1"}, bad("conversation")),
    ({"reasoning": {"effort": "high"}}, ok_or_bad("reasoning")),
    ({"include": ["file_search_call.results"]}, bad("include")),
    ({"include": "message.output_text.logprobs"}, bad("include")),
    ({"metadata": {"k": 5}}, bad("metadata")),
    ({"metadata": nested(DEEP)}, bad("metadata", statuses=(400, 413))),
    ({"user": ["u"]}, bad("user")),
    ({"unknown_field": 1}, bad("unknown_field")),
]


def _input(rng: random.Random):
    """A valid ``input``: a string, or messages with string or ``input_text`` content."""
    if rng.random() < 0.4:
        return rng.choice(PROMPTS + WORDS)
    items = []
    if rng.random() < 0.3:
        items.append({"role": rng.choice(["system", "developer"]), "content": "Be brief."})
    text = rng.choice(WORDS)
    if rng.random() < 0.5:
        items.append({"role": "user", "content": text})
    else:
        items.append(
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        )
    return items


def responses_body(rng: random.Random, model: str) -> dict:
    """A valid request body (any combination of its fields is valid)."""
    maybe = rng.random
    body: dict = {"input": _input(rng), "max_output_tokens": rng.randint(1, 4)}
    if maybe() < 0.7:
        body["model"] = model
    if maybe() < 0.3:
        body["instructions"] = rng.choice(["Answer in one word.", "", "Réponds en français."])
    if maybe() < 0.4:
        body["temperature"] = rng.choice([0, 0.0, 0.7, 1, 2])
    if maybe() < 0.3:
        body["top_p"] = rng.choice([1e-9, 0.5, 1])
    if maybe() < 0.4:
        body["stream"] = maybe() < 0.6
    if maybe() < 0.4:
        body["store"] = maybe() < 0.5
    if maybe() < 0.2:
        body["text"] = {"format": rng.choice(FORMATS)}
    elif maybe() < 0.15:
        body["tools"] = [TOOL]
        body["tool_choice"] = rng.choice(
            ["none", "required", {"type": "function", "name": "get_weather"}]
        )
    if maybe() < 0.15:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = rng.randint(0, 5)
    for name, value in (
        ("metadata", {"k": "v"}),
        ("user", "u-1"),
        ("safety_identifier", "s"),
        ("prompt_cache_key", "k"),
        ("parallel_tool_calls", False),
        ("max_tool_calls", 2),
    ):
        if maybe() < 0.08:
            body[name] = value
    return body


def _case(case_id: int, label: str, body: dict, expect=OK, **kw) -> Case:
    stream = body.get("stream") is True
    return Case(
        case_id,
        label,
        "POST",
        RESPONSES_PATH,
        encode_body(body),
        dict(JSON_HEADERS),
        expect,
        kind="responses",
        stream=stream,
        **kw,
    )


def responses_cases(seed: int, count: int, model: str, start: int = 200_000) -> list[Case]:
    """``count`` random cases (about half with one fault, a few GET/DELETE of unknown ids),
    numbered from ``start``; the same ``seed`` gives the same cases."""
    rng = random.Random(seed * 7919 + 11)
    cases = []
    for case_id in range(start, start + count):
        roll = rng.random()
        if roll < 0.08:
            method = rng.choice(["GET", "DELETE"])
            ident = rng.choice(["resp_never_stored", "x" * 500, "%FF", "resp_%00", "msg_1"])
            path = f"{RESPONSES_PATH}/{ident}"
            expect = bad("response_id", statuses=(404,))
            cases.append(
                Case(
                    case_id,
                    f"{method} unknown response",
                    method,
                    path,
                    None,
                    {},
                    expect,
                    kind="error",
                )
            )
            continue
        if roll < 0.1:
            method = rng.choice(["PUT", "PATCH"])
            cases.append(
                Case(
                    case_id,
                    f"{method} responses",
                    method,
                    RESPONSES_PATH,
                    None,
                    {},
                    any_error(405),
                    kind="error",
                )
            )
            continue
        body = responses_body(rng, model)
        if roll < 0.55:
            fields, expect = rng.choice(FAULTS)
            body.update(fields)
            if body.get("input") is None:
                body.pop("input")
            label = f"responses: {json.dumps(fields, default=repr)[:100]}"
            cases.append(_case(case_id, label, body, expect))
        else:
            cases.append(_case(case_id, "responses: valid", body))
    return cases


# --- judging a 200 --------------------------------------------------------------------------


def _check_response(data: dict, where: str) -> list[str]:
    """Problems of a whole Response object (a non-streamed answer, or a stream's last)."""
    problems = []
    if data.get("object") != "response" or not str(data.get("id", "")).startswith("resp_"):
        problems.append(f"{where}: object {data.get('object')!r}, id {data.get('id')!r}")
    if data.get("status") not in FINAL_STATUSES:
        problems.append(f"{where}: status {data.get('status')!r}")
    if data.get("status") == "incomplete" and not data.get("incomplete_details"):
        problems.append(f"{where}: incomplete without incomplete_details")
    output = data.get("output")
    if not isinstance(output, list):
        return problems + [f"{where}: output is {output!r:.200}"]
    for i, item in enumerate(output):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            parts = item.get("content")
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
            ):
                problems.append(f"{where}: output[{i}] message content {parts!r:.200}")
        elif kind == "function_call":
            if not isinstance(item.get("arguments"), str) or not item.get("call_id"):
                problems.append(f"{where}: output[{i}] function call {item!r:.200}")
        elif kind != "reasoning":
            problems.append(f"{where}: output[{i}] of type {kind!r}")
    usage = data.get("usage") or {}
    if not all(isinstance(usage.get(k), int) for k in ("input_tokens", "output_tokens")):
        problems.append(f"{where}: usage {usage!r:.200}")
    return problems


def _check_events(body: bytes) -> list[str]:
    """Problems of a streamed answer: named events, strict JSON, rising sequence numbers,
    ``response.created`` first and a final response last, no error event."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [f"stream is not UTF-8: {exc}"]
    pairs, problems = named_events(text)
    events = []
    for name, data in pairs:
        if data.get("type") != name:
            problems.append(f"event {name!r} carries type {data.get('type')!r}")
        events.append(data)
    if not events:
        return problems + ["an empty stream"]
    numbers = [event.get("sequence_number") for event in events]
    if numbers != list(range(len(events))):
        problems.append(f"sequence numbers {numbers[:20]}")
    names = [event.get("type") for event in events]
    if names[0] != "response.created" or names[-1] not in (
        "response.completed",
        "response.incomplete",
    ):
        problems.append(f"events from {names[0]!r} to {names[-1]!r}")
    if "error" in names or "response.failed" in names:
        problems.append(f"an error event: {text[-400:]!r}")
    if names[-1] in ("response.completed", "response.incomplete"):
        problems += _check_response(events[-1].get("response") or {}, "final event")
    return problems


def check_responses_200(case: Case, headers: httpx.Headers, body: bytes) -> list[str]:
    """Everything wrong with a 200 to a ``POST /v1/responses`` case."""
    streamed = headers.get("content-type", "").startswith("text/event-stream")
    if streamed != case.stream:
        return [f"answered with content-type {headers.get('content-type')!r}"]
    if streamed:
        return _check_events(body)
    try:
        data = strict_json(body)
    except ValueError as exc:
        return [f"200 body is not strict JSON ({exc}): {body[:300]!r}"]
    return _check_response(data, "response")


# --- stored responses: create, retrieve, delete ----------------------------------------------


def _created_id(response: httpx.Response, streamed: bool) -> str:
    if not streamed:
        return response.json()["id"]
    first = response.text.split("\n\n")[0].split("\n")[1][len("data: ") :]
    return json.loads(first)["response"]["id"]


def check_stored_round_trip(base_url: str, model: str, seed: int, count: int = 6) -> list[str]:
    """Create ``count`` stored responses (streamed and not), then for each: retrieve it (the
    same output as created), chain a new one on it with ``previous_response_id``, delete it
    (``deleted: true``), and see it gone (404 to retrieve, delete and chaining). Returns the
    problems found."""
    rng = random.Random(seed)
    problems = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for i in range(count):
            body = {**responses_body(rng, model), "store": True, "stream": i % 2 == 1}
            body.pop("tools", None), body.pop("tool_choice", None)
            created = client.post(RESPONSES_PATH, json=body)
            if created.status_code != 200:
                problems.append(f"create {body!r:.200}: {created.status_code} {created.text[:200]}")
                continue
            rid = _created_id(created, body["stream"])
            got = client.get(f"{RESPONSES_PATH}/{rid}")
            if got.status_code != 200 or got.json().get("id") != rid:
                problems.append(f"retrieve {rid}: {got.status_code} {got.text[:200]}")
            elif not body["stream"] and got.json()["output"] != created.json()["output"]:
                problems.append(f"retrieve {rid}: another output than created")
            chained = client.post(
                RESPONSES_PATH,
                json={
                    "model": model,
                    "input": "And?",
                    "max_output_tokens": 2,
                    "previous_response_id": rid,
                },
            )
            if chained.status_code != 200:
                problems.append(f"chain on {rid}: {chained.status_code} {chained.text[:200]}")
            deleted = client.delete(f"{RESPONSES_PATH}/{rid}")
            if deleted.status_code != 200 or deleted.json().get("deleted") is not True:
                problems.append(f"delete {rid}: {deleted.status_code} {deleted.text[:200]}")
            for method in ("GET", "DELETE"):
                again = client.request(method, f"{RESPONSES_PATH}/{rid}")
                if again.status_code != 404:
                    problems.append(f"{method} {rid} after delete: {again.status_code}")
            again = client.post(
                RESPONSES_PATH,
                json={"model": model, "input": "x", "previous_response_id": rid},
            )
            if again.status_code != 404:
                problems.append(f"chain on deleted {rid}: {again.status_code}")
    return problems
