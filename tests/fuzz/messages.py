"""Anthropic's Messages API's share of the fuzz (``tests/entrypoints/openai/test_fuzz.py``): random
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` bodies, valid and faulty, streamed
and not, and the routes' wrong methods.

Cases are :class:`tests.fuzz.cases.Case` with ``kind="messages"``: every 4xx of theirs must
be in Anthropic's error shape, its message naming the field the corpus expects
(:func:`tests.fuzz.checks.check_anthropic_error_body`); :func:`check_messages_200` judges a
200 (strict JSON, a ``message`` of the assistant with content blocks of known types, a known
``stop_reason`` and integer ``usage``; a stream of named SSE events from ``message_start`` to
``message_stop`` with well-nested content blocks and no ``error`` event; a token count's
``{"input_tokens"}``). What each fault must name follows the server's contract
(``pyxllm/entrypoints/anthropic/``): refused fields, blocks and turns are a 400 whose message
starts with the field at fault.
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
from tests.fuzz.checks import named_events, strict_json

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOL_CHOICES = [
    {"type": "auto"},
    {"type": "any"},
    {"type": "tool", "name": "get_weather"},
    {"type": "none"},
    {"type": "any", "disable_parallel_tool_use": True},
]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
HI = [{"role": "user", "content": "Hi"}]
# (fields, what a correct server answers): one fault each, to either route (the faults of the
# fields only /v1/messages declares are CREATE_FAULTS, sent to it alone)
FAULTS: list[tuple[dict, object]] = [
    ({"messages": [], "system": None}, bad("messages")),
    ({"messages": [], "system": "Be brief."}, bad("messages")),  # as Anthropic's API
    ({"messages": "Hello"}, bad("messages")),
    ({"messages": None}, bad("messages")),  # left out
    ({"messages": [{"role": "user"}]}, bad("messages")),
    ({"messages": [{"role": "tool", "content": "x"}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": 5}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, bad("messages")),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}]},
        bad("messages"),
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        bad("messages"),
    ),
    ({"messages": [{"role": "user", "content": [{"type": "nonsense"}]}]}, bad("messages")),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        bad("messages"),
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        bad("messages"),
    ),
    (
        {"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
        bad("messages"),
    ),
    # a last turn of the assistant (to be continued): the chat templates cannot
    ({"messages": [*HI, {"role": "assistant", "content": "Hel"}]}, bad("messages")),
    # a first turn of the assistant: Anthropic takes it, so may a server
    (
        {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Hi"}]},
        ok_or_bad("messages"),
    ),
    ({"messages": [{"role": "user", "content": "\udfff"}]}, bad("messages")),
    ({"messages": [{"role": "user", "content": Raw(b'"\xff"')}]}, bad("messages", null_ok=True)),
    (
        {"messages": [{"role": "user", "content": nested(DEEP)}]},
        bad("messages", statuses=(400, 413)),
    ),
    ({"system": 5}, bad("system")),
    ({"system": [{"type": "text", "text": 5}]}, bad("system")),
    ({"system": [IMAGE]}, bad("system")),
    ({"system": "a\ud800b"}, bad("system")),
    ({"thinking": {"type": "adaptive"}}, bad("thinking")),
    ({"thinking": "on"}, bad("thinking")),
    ({"tools": "x"}, bad("tools")),
    ({"tools": [{"name": "f"}]}, bad("tools")),
    ({"tools": [{"input_schema": {"type": "object"}}]}, bad("tools")),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, bad("tools")),
    ({"tools": [{**TOOL, "defer_loading": True}]}, bad("tools")),
    ({"tools": [{**TOOL, "input_schema": nested(DEEP, "{}", "object")}]}, bad("tools")),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, bad("tool_choice")),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, bad("tool_choice")),
    ({"tools": [TOOL], "tool_choice": "auto"}, bad("tool_choice")),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, bad("tool_choice")),
    ({"model": "claude-sonnet-4-5"}, bad("model", statuses=(404,))),
    ({"model": 5}, bad("model")),
    ({"model": None}, bad("model")),  # left out
    ({"model": "\udfff"}, bad("model")),
    ({"output_config": {"effort": "low"}}, bad("output_config")),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, bad("mcp_servers")),
    ({"context_management": {"edits": []}}, bad("context_management")),
    ({"speed": "fast"}, bad("speed")),
    # a field no Messages request declares (the SDK may send newer ones)
    ({"unknown_field": 1}, bad("unknown_field")),
]
# Faults of the fields only /v1/messages declares.
CREATE_FAULTS: list[tuple[dict, object]] = [
    # a budget needs --reasoning-parser, which the fuzz server has not (a count takes it)
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, bad("thinking")),
    ({"max_tokens": None}, bad("max_tokens")),  # left out: required
    ({"max_tokens": 0}, bad("max_tokens")),
    ({"max_tokens": -3}, bad("max_tokens")),
    ({"max_tokens": "many"}, bad("max_tokens")),
    ({"max_tokens": 2.5}, bad("max_tokens")),
    ({"max_tokens": 10**12}, bad("max_tokens")),
    ({"max_tokens": 2**64}, bad("max_tokens")),
    ({"temperature": 1.5}, bad("temperature")),
    ({"temperature": -1}, bad("temperature")),
    ({"temperature": "hot"}, bad("temperature")),
    ({"temperature": Raw("NaN")}, bad("temperature", null_ok=True)),
    ({"top_p": 1.5}, bad("top_p")),
    ({"top_p": 0}, bad("top_p")),
    ({"top_k": -5}, bad("top_k")),
    ({"top_k": 2**64}, ok_or_bad("top_k")),  # as chat: any k above the vocabulary is all of it
    ({"stop_sequences": "x"}, bad("stop_sequences")),
    ({"stop_sequences": [5]}, bad("stop_sequences")),
    ({"stop_sequences": ["s"] * 100}, bad("stop_sequences")),
    ({"stop_sequences": ["\udfff"]}, bad("stop_sequences")),
    ({"stream": "sometimes"}, bad("stream")),
    ({"metadata": "x"}, bad("metadata")),
    ({"metadata": nested(DEEP)}, bad("metadata", statuses=(400, 413))),
    ({"service_tier": "priority"}, bad("service_tier")),
    ({"container": "c"}, bad("container")),
    ({"inference_geo": "us"}, bad("inference_geo")),
]
# Bodies that are not a Messages request at all: any 400.
BROKEN_BODIES = [b"", b"[]", b"5", b'"x"', b"{", b'{"model": }', b"null"]


def _text(rng: random.Random, words: list[str] = WORDS) -> str | list[dict]:
    """A turn's content: a text, or text blocks."""
    if rng.random() < 0.6:
        return rng.choice(words)
    blocks = [{"type": "text", "text": rng.choice(words)} for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.2:
        blocks[-1]["cache_control"] = {"type": "ephemeral"}
    return blocks


def _turns(rng: random.Random, tools: bool) -> list[dict]:
    """A valid conversation: user and assistant turns taking turns, a call and its result
    (with ``tools``), ending with a user turn."""
    turns = []
    for _ in range(rng.randint(0, 2)):
        turns.append({"role": "user", "content": _text(rng, PROMPTS + WORDS)})
        turns.append({"role": "assistant", "content": _text(rng)})
    if tools and rng.random() < 0.5:
        call = {
            "type": "tool_use",
            "id": "toolu_1",
            "name": "get_weather",
            "input": {"city": "Oslo"},
        }
        before = [{"type": "text", "text": "Let me see."}] if rng.random() < 0.5 else []
        result: dict = {"type": "tool_result", "tool_use_id": "toolu_1"}
        result["content"] = rng.choice(["Sunny.", [{"type": "text", "text": "Rain."}], None])
        if result["content"] is None:
            del result["content"]
        if rng.random() < 0.2:
            result["is_error"] = True
        after = [{"type": "text", "text": "And tomorrow?"}] if rng.random() < 0.5 else []
        turns.append({"role": "user", "content": "What is the weather in Oslo?"})
        turns.append({"role": "assistant", "content": [*before, call]})
        turns.append({"role": "user", "content": [result, *after]})
    else:
        turns.append({"role": "user", "content": _text(rng, PROMPTS + WORDS)})
    return turns


def messages_body(rng: random.Random, model: str, count: bool = False) -> dict:
    """A valid request body of ``/v1/messages`` (of ``/v1/messages/count_tokens`` with
    ``count``: no sampling fields); any combination of its fields is valid."""
    maybe = rng.random
    tools = maybe() < 0.25
    body: dict = {"model": model, "messages": _turns(rng, tools)}
    if not count:
        body["max_tokens"] = rng.randint(1, 4)
    if maybe() < 0.4:
        body["system"] = _text(rng, ["Be brief.", "Answer in one word.", "Réponds en français."])
    if tools:
        body["tools"] = [TOOL]
        if maybe() < 0.8:
            body["tool_choice"] = rng.choice(TOOL_CHOICES)
    if maybe() < 0.1:
        body["thinking"] = {"type": "disabled"}
    if count:
        return body
    if maybe() < 0.4:
        body["temperature"] = rng.choice([0, 0.0, 0.5, 1])
    if maybe() < 0.25:
        body["top_p"] = rng.choice([1e-9, 0.5, 1])
    if maybe() < 0.25:
        body["top_k"] = rng.choice([1, 5, 40])
    if maybe() < 0.3:
        body["stop_sequences"] = rng.sample(
            [".", "\n", " ", "the", "!", "Paris"], rng.randint(0, 3)
        )
    if maybe() < 0.5:
        body["stream"] = maybe() < 0.6
    for name, value in (
        ("metadata", {"user_id": "u-1"}),
        ("service_tier", rng.choice(["auto", "standard_only"])),
        ("cache_control", {"type": "ephemeral"}),
        ("speed", "standard"),
    ):
        if maybe() < 0.06:
            body[name] = value
    return body


def messages_case(case_id: int, label: str, path: str, body: dict | bytes, expect=OK) -> Case:
    """A ``POST`` of ``body`` (a dict to encode, or bytes as they are) to ``path``."""
    stream = isinstance(body, dict) and body.get("stream") is True and path == MESSAGES_PATH
    content = body if isinstance(body, bytes) else encode_body(body)
    return Case(
        case_id,
        label,
        "POST",
        path,
        content,
        dict(JSON_HEADERS),
        expect,
        kind="messages",
        stream=stream,
    )


def messages_cases(seed: int, count: int, model: str, start: int = 300_000) -> list[Case]:
    """``count`` random cases (about 45% with one fault, a few of the wrong method or not a
    request at all, a fifth of them token counts), numbered from ``start``; the same ``seed``
    gives the same cases."""
    rng = random.Random(seed * 7907 + 13)
    cases = []
    for case_id in range(start, start + count):
        roll = rng.random()
        path = COUNT_TOKENS_PATH if rng.random() < 0.2 else MESSAGES_PATH
        name = path.rsplit("/", 1)[-1]
        if roll < 0.06:
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
            expect = any_error(405)
            case = Case(case_id, f"{method} {name}", method, path, None, {}, expect, "messages")
            cases.append(case)
            continue
        if roll < 0.09:
            body = rng.choice(BROKEN_BODIES)
            cases.append(
                messages_case(case_id, f"{name}: not a request", path, body, any_error(400))
            )
            continue
        body = messages_body(rng, model, count=path == COUNT_TOKENS_PATH)
        if roll < 0.55:
            faults = FAULTS if path == COUNT_TOKENS_PATH else FAULTS + CREATE_FAULTS
            fields, expect = rng.choice(faults)
            body.update(fields)
            for key in [k for k, v in fields.items() if v is None]:
                body.pop(key)
            if "tools" in fields and "tool_choice" not in fields:
                body.pop("tool_choice", None)  # its fault is the tools' alone
                for turn in body["messages"]:
                    if isinstance(turn["content"], list) and turn["role"] == "assistant":
                        turn["content"] = "Sure."  # no call to a tool it no longer has
            label = f"{name}: {json.dumps(fields, default=repr)[:100]}"
            cases.append(messages_case(case_id, label, path, body, expect))
        else:
            cases.append(messages_case(case_id, f"{name}: valid", path, body))
    return cases


# --- judging a 200 --------------------------------------------------------------------------


def _request(case: Case) -> dict:
    """The case's body as sent (a valid case's: JSON)."""
    try:
        body = json.loads(case.body or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _tool_names(request: dict) -> set[str]:
    return {t.get("name") for t in request.get("tools") or () if isinstance(t, dict)}


def _check_block(block, where: str, tools: set[str], streamed: bool = False) -> list[str]:
    """Problems of one content block (a stream's ``content_block_start`` has empty ones)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return []
    if kind == "thinking" and isinstance(block.get("thinking"), str):
        return []
    if kind == "tool_use":
        if not isinstance(block.get("input"), dict) or not isinstance(block.get("id"), str):
            return [f"{where}: tool_use block {block!r:.200}"]
        if block.get("name") not in tools and not (streamed and block.get("name") == ""):
            return [f"{where}: a call to {block.get('name')!r}, not an offered tool"]
        return []
    return [f"{where}: block {block!r:.200}"]


def _check_usage(usage, where: str, keys=("input_tokens", "output_tokens")) -> list[str]:
    if not isinstance(usage, dict) or not all(
        isinstance(usage.get(k), int) and not isinstance(usage.get(k), bool) and usage[k] >= 0
        for k in (*keys, "cache_creation_input_tokens", "cache_read_input_tokens")
    ):
        return [f"{where}: usage {usage!r:.200}"]
    return []


def _check_stop(reason, sequence, request: dict, content: list, where: str) -> list[str]:
    """``stop_reason`` and ``stop_sequence`` against the request and the content."""
    if reason not in STOP_REASONS:
        return [f"{where}: stop_reason {reason!r}"]
    if reason == "stop_sequence":
        if sequence not in (request.get("stop_sequences") or ()):
            return [f"{where}: stop_sequence {sequence!r} is none of the request's"]
    elif sequence is not None:
        return [f"{where}: stop_sequence {sequence!r} with stop_reason {reason!r}"]
    calls = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
    if reason == "tool_use" and not calls:
        return [f"{where}: stop_reason tool_use without a tool_use block"]
    if reason in ("end_turn", "stop_sequence") and calls:
        return [f"{where}: tool_use blocks with stop_reason {reason!r}"]
    return []


def _check_message(data: dict, request: dict) -> list[str]:
    """Problems of a whole non-streamed Message."""
    problems = []
    if data.get("type") != "message" or data.get("role") != "assistant":
        problems.append(f"type {data.get('type')!r}, role {data.get('role')!r}")
    if not str(data.get("id", "")).startswith("msg_") or not isinstance(data.get("model"), str):
        problems.append(f"id {data.get('id')!r}, model {data.get('model')!r}")
    content = data.get("content")
    if not isinstance(content, list):
        return problems + [f"content is {content!r:.200}"]
    for i, block in enumerate(content):
        problems += _check_block(block, f"content[{i}]", _tool_names(request))
    problems += _check_stop(
        data.get("stop_reason"), data.get("stop_sequence"), request, content, "message"
    )
    problems += _check_usage(data.get("usage"), "message")
    usage = data.get("usage") or {}
    if data.get("stop_reason") == "max_tokens" and usage.get("output_tokens") != request.get(
        "max_tokens"
    ):
        problems.append(f"stop_reason max_tokens after {usage.get('output_tokens')} tokens")
    return problems


DELTA_TYPES = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def _check_events(body: bytes, request: dict) -> list[str]:
    """Problems of a streamed answer: named events of strict JSON, ``message_start`` first,
    content blocks started, filled with deltas of their type and stopped in index order,
    ``message_delta`` then ``message_stop`` last, no ``error`` event."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [f"stream is not UTF-8: {exc}"]
    pairs, problems = named_events(text)
    events = []
    for name, data in pairs:
        if not isinstance(data, dict) or data.get("type") != name:
            problems.append(f"event {name!r} carries {data!r:.200}")
            continue
        events.append(data)
    names = [event["type"] for event in events]
    if "error" in names:
        return problems + [f"an error event: {text[-400:]!r}"]
    if names[:1] != ["message_start"] or names[-2:] != ["message_delta", "message_stop"]:
        return problems + [f"events {names[:3]} ... {names[-3:]}"]
    start = events[0].get("message") or {}
    if start.get("type") != "message" or start.get("role") != "assistant":
        problems.append(f"message_start {start!r:.200}")
    problems += _check_usage(start.get("usage"), "message_start")
    tools = _tool_names(request)
    blocks: list[dict] = []
    open_index = None
    for event in events[1:-2]:
        kind, index = event["type"], event.get("index")
        if kind == "ping":
            continue
        if kind == "content_block_start":
            if open_index is not None or index != len(blocks):
                problems.append(f"block {index} starts with block {open_index} open")
            block = event.get("content_block")
            problems += _check_block(block, f"content_block_start {index}", tools, True)
            blocks.append(dict(block) if isinstance(block, dict) else {})
            blocks[-1]["partial_json"] = ""
            open_index = index
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            if index != open_index or open_index is None:
                problems.append(f"a delta of block {index} with block {open_index} open")
                continue
            block = blocks[index]
            want = DELTA_TYPES.get(block.get("type"))
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(want, "partial_json")
            if delta.get("type") != want or not isinstance(delta.get(field), str):
                problems.append(f"a delta {delta!r:.200} of a {block.get('type')} block")
            else:
                block[field] = block.get(field, "") + delta[field]
        elif kind == "content_block_stop":
            if index != open_index:
                problems.append(f"block {index} stops with block {open_index} open")
            open_index = None
        else:
            problems.append(f"event {kind!r} between message_start and message_delta")
    if open_index is not None:
        problems.append(f"block {open_index} never stopped")
    final = events[-2]
    delta = final.get("delta") or {}
    problems += _check_stop(
        delta.get("stop_reason"), delta.get("stop_sequence"), request, blocks, "message_delta"
    )
    problems += _check_usage(final.get("usage"), "message_delta")
    if delta.get("stop_reason") == "tool_use":
        for block in blocks:
            if block.get("type") != "tool_use":
                continue
            try:
                value = json.loads(block["partial_json"] or "{}")
            except ValueError:
                value = None
            if not isinstance(value, dict):
                problems.append(f"a finished call's input {block['partial_json']!r:.200}")
    return problems


def check_messages_200(case: Case, headers: httpx.Headers, body: bytes) -> list[str]:
    """Everything wrong with a 200 to a ``POST /v1/messages`` or ``count_tokens`` case."""
    streamed = headers.get("content-type", "").startswith("text/event-stream")
    if streamed != case.stream:
        return [f"answered with content-type {headers.get('content-type')!r}"]
    request = _request(case)
    if streamed:
        return _check_events(body, request)
    try:
        data = strict_json(body)
    except ValueError as exc:
        return [f"200 body is not strict JSON ({exc}): {body[:300]!r}"]
    if not isinstance(data, dict):
        return [f"200 body {data!r:.200}"]
    if case.path == COUNT_TOKENS_PATH:
        count = data.get("input_tokens")
        if set(data) != {"input_tokens"} or not isinstance(count, int) or count < 1:
            return [f"token count {data!r:.200}"]
        return []
    return _check_message(data, request)
