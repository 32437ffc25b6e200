"""Judging the server's answers to the fuzz corpus's cases (:mod:`tests.fuzz.cases`): status
and error shape, JSON and SSE without NaN or Infinity, logprobs, choices."""

from __future__ import annotations

import json
import math
import re

import httpx

from tests.fuzz.cases import Case

# --- judging answers ---------------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def named_events(text: str) -> tuple[list[tuple[str, object]], list[str]]:
    """The ``(name, data)`` of each event of a stream of named server-sent events (blocks of
    ``event: NAME`` and ``data: JSON``, the data strict JSON), and the problems of the blocks
    that are not such events (the Responses and Messages streams' shape)."""
    problems, events = [], []
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        if (
            len(lines) != 2
            or not lines[0].startswith("event: ")
            or not lines[1].startswith("data: ")
        ):
            problems.append(f"stream block {block[:200]!r}")
            continue
        try:
            data = strict_json(lines[1][len("data: ") :])
        except ValueError as exc:
            problems.append(f"event data is not strict JSON ({exc}): {lines[1][:200]!r}")
            continue
        events.append((lines[0][len("event: ") :], data))
    return events, problems


def strict_json(text: str | bytes):
    """``json.loads`` refusing NaN, Infinity and -Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


def param_matches(param: str | None, expected: frozenset[str]) -> bool:
    """``param`` is one of ``expected``, or a path inside one (``messages[0].content``)."""
    if not isinstance(param, str):
        return False
    return any(param == p or param.startswith((p + ".", p + "[")) for p in expected)


def check_error_body(status: int, body: bytes) -> tuple[list[str], dict | None]:
    """Problems of a 4xx body (OpenAI's error shape), and its ``error`` object."""
    try:
        error = strict_json(body)["error"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{status} without OpenAI's error body ({exc}): {body[:300]!r}"], None
    problems = []
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
        return [f"{status} error body lacks message/type/param/code: {body[:300]!r}"], None
    if error["code"] != status:
        problems.append(f"error code {error['code']!r} is not the status {status}")
    if not isinstance(error["message"], str) or not error["message"]:
        problems.append("error message is empty")
    if not isinstance(error["type"], str) or not error["type"]:
        problems.append("error type is empty")
    if error["param"] is not None and not isinstance(error["param"], str):
        problems.append(f"error param {error['param']!r} is not a string")
    return problems, error


# Anthropic's error type of each status (another 4xx: ``invalid_request_error``).
ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
_FIELD_PATH = re.compile(r"[A-Za-z_]\w*(?:\[\d+\]|\.\w+)*")


def check_anthropic_error_body(status: int, body: bytes) -> tuple[list[str], dict | None]:
    """Problems of a 4xx body of Anthropic's routes (``{"type": "error", "error": {"type",
    "message"}}``, the type Anthropic's for the status), and its ``error`` object."""
    try:
        data = strict_json(body)
        error = data["error"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{status} without Anthropic's error body ({exc}): {body[:300]!r}"], None
    if (
        data.get("type") != "error"
        or not isinstance(error, dict)
        or set(error)
        != {
            "type",
            "message",
        }
    ):
        return [f"{status} is not in Anthropic's error shape: {body[:300]!r}"], None
    problems = []
    want = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error")
    if error["type"] != want:
        problems.append(f"error type {error['type']!r} of a {status}, not {want!r}")
    if not isinstance(error["message"], str) or not error["message"]:
        problems.append("error message is empty")
    return problems, error


def message_names(message: str, expected: frozenset[str]) -> bool | None:
    """Whether an Anthropic error ``message`` names one of the ``expected`` fields: its
    leading ``field: problem`` path (prefix match, as :func:`param_matches`), else a mention of
    the field as a word; ``None`` when it names no field at all."""
    head, sep, _ = message.partition(": ")
    if sep and _FIELD_PATH.fullmatch(head):
        return param_matches(head, expected)
    if any(re.search(rf"(?<![\w.\[]){re.escape(p)}(?![\w])", message) for p in expected):
        return True
    return None


def _check_logprob(value, where: str, nullable: bool = False) -> list[str]:
    if value is None and nullable:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return [f"{where}: logprob {value!r} is not a finite number"]
    if value > 1e-6:
        return [f"{where}: logprob {value!r} > 0"]
    return []


def _check_chat_logprobs(logprobs, where: str) -> list[str]:
    problems = []
    if logprobs is None:
        return problems
    for j, entry in enumerate(logprobs.get("content") or []):
        problems += _check_logprob(entry.get("logprob"), f"{where}.content[{j}]")
        for k, top in enumerate(entry.get("top_logprobs") or []):
            problems += _check_logprob(top.get("logprob"), f"{where}.content[{j}].top[{k}]")
    return problems


def _check_completion_logprobs(logprobs, where: str, first_nullable: bool) -> list[str]:
    problems = []
    if logprobs is None:
        return problems
    for j, value in enumerate(logprobs.get("token_logprobs") or []):
        problems += _check_logprob(value, f"{where}.token_logprobs[{j}]", first_nullable and j == 0)
    for j, top in enumerate(logprobs.get("top_logprobs") or []):
        if top is None and first_nullable and j == 0:
            continue
        if not isinstance(top, dict):
            problems.append(f"{where}.top_logprobs[{j}] is {top!r}")
            continue
        for token, value in top.items():
            problems += _check_logprob(value, f"{where}.top_logprobs[{j}][{token!r}]")
    return problems


def choice_text(kind: str, choice: dict) -> str:
    """A non-streamed choice's text."""
    if kind == "chat":
        return choice["message"].get("content") or ""
    return choice["text"]


def check_generation(case: Case, body: bytes) -> tuple[list[str], list[str]]:
    """Problems of a non-streamed 200 of chat or completions, and each choice's text."""
    try:
        data = strict_json(body)
    except ValueError as exc:
        return [f"200 body is not strict JSON ({exc}): {body[:300]!r}"], []
    problems: list[str] = []
    want = "chat.completion" if case.kind == "chat" else "text_completion"
    if data.get("object") != want:
        problems.append(f"object is {data.get('object')!r}, not {want}")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != case.n:
        return problems + [f"{len(choices or [])} choices, not n={case.n}"], []
    if sorted(c.get("index") for c in choices) != list(range(case.n)):
        problems.append(f"choice indices {[c.get('index') for c in choices]}")
    texts = [""] * case.n
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        i = choice.get("index", 0)
        if not choice.get("finish_reason"):
            problems.append(f"choice {i} has no finish_reason")
        try:
            texts[i] = choice_text(case.kind, choice)
        except (KeyError, TypeError, AttributeError):
            problems.append(f"choice {i} has no text: {choice!r:.200}")
        if case.kind == "chat":
            problems += _check_chat_logprobs(choice.get("logprobs"), f"choices[{i}].logprobs")
        else:
            problems += _check_completion_logprobs(
                choice.get("logprobs"), f"choices[{i}].logprobs", case.echo
            )
    usage = data.get("usage") or {}
    if not all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens")):
        problems.append(f"usage is {usage!r}")
    return problems, texts


def parse_sse(body: bytes) -> tuple[list[str], list[str]]:
    """``(problems, data payloads)`` of an SSE body; it must end with ``data: [DONE]``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [f"stream is not UTF-8: {exc}"], []
    problems, payloads = [], []
    for line in text.split("\n"):
        if line.startswith("data: "):
            payloads.append(line[len("data: ") :])
        elif line and not line.startswith(":"):
            problems.append(f"unexpected stream line {line[:200]!r}")
    if not payloads or payloads[-1] != "[DONE]" or not text.endswith("data: [DONE]\n\n"):
        problems.append(f"stream does not end with data: [DONE]: ...{text[-300:]!r}")
    if payloads.count("[DONE]") > 1:
        problems.append("stream has several [DONE]")
    return problems, payloads


def check_stream(case: Case, body: bytes) -> tuple[list[str], list[str]]:
    """Problems of a streamed 200 of chat or completions, and each choice's text."""
    problems, payloads = parse_sse(body)
    want = "chat.completion.chunk" if case.kind == "chat" else "text_completion"
    texts = [""] * case.n
    finished = [0] * case.n
    first_seen = [False] * case.n
    chunks = []
    for payload in payloads:
        if payload == "[DONE]":
            continue
        try:
            chunk = strict_json(payload)
        except ValueError as exc:
            problems.append(f"stream chunk is not strict JSON ({exc}): {payload[:300]!r}")
            continue
        chunks.append(chunk)
        if "error" in chunk:
            problems.append(f"stream carries an error event: {payload[:400]}")
            continue
        if chunk.get("object") != want:
            problems.append(f"chunk object {chunk.get('object')!r}, not {want}")
        for choice in chunk.get("choices") or []:
            i = choice.get("index")
            if not isinstance(i, int) or not 0 <= i < case.n:
                problems.append(f"chunk choice index {i!r} with n={case.n}")
                continue
            if choice.get("finish_reason"):
                finished[i] += 1
            elif finished[i]:
                problems.append(f"choice {i} continues after its finish_reason")
            if case.kind == "chat":
                delta = choice.get("delta") or {}
                texts[i] += delta.get("content") or ""
                problems += _check_chat_logprobs(choice.get("logprobs"), f"chunk choice {i}")
            else:
                texts[i] += choice.get("text") or ""
                problems += _check_completion_logprobs(
                    choice.get("logprobs"), f"chunk choice {i}", case.echo and not first_seen[i]
                )
            first_seen[i] = True
    if any(count != 1 for count in finished):
        problems.append(f"finish_reason counts per choice {finished} (each must be 1)")
    if case.include_usage:
        last = chunks[-1] if chunks else {}
        if not last.get("usage") or last.get("choices"):
            problems.append(f"include_usage: last chunk {json.dumps(last)[:200]} has no usage")
    return problems, texts


def check_other_200(case: Case, headers: httpx.Headers, body: bytes) -> list[str]:
    """Problems of a 200 of the other routes."""
    if case.kind in ("health",) or case.method == "HEAD":
        return []
    if case.kind == "metrics":
        return [] if b"# HELP" in body or b"# TYPE" in body else [f"metrics: {body[:200]!r}"]
    try:
        data = strict_json(body)
    except ValueError as exc:
        return [f"200 body is not strict JSON ({exc}): {body[:300]!r}"]
    if case.kind == "tokenize":
        ok = isinstance(data.get("tokens"), list) and data.get("count") == len(data["tokens"])
        return [] if ok else [f"tokenize answer {data!r:.300}"]
    if case.kind == "detokenize":
        return [] if isinstance(data.get("prompt"), str) else [f"detokenize answer {data!r:.300}"]
    if case.kind == "stats":
        return [] if "num_running" in data else [f"stats answer {data!r:.300}"]
    return []


def check_case(
    case: Case,
    status: int | None,
    headers: httpx.Headers | None,
    body: bytes,
    transport_error: str | None,
    references: dict[bytes, str] | None = None,
) -> list[str]:
    """Everything wrong with the answer to ``case`` (empty: correct)."""
    if transport_error is not None:
        return [f"no answer: {transport_error}"]
    assert status is not None and headers is not None
    if status >= 500:
        return [f"answered {status}: {body[:600]!r}"]
    if case.method == "HEAD":  # no body to judge
        allowed = (status == 200 and case.expect.ok) or status in case.expect.errors
        return [] if allowed else [f"answered {status}, expected {case.expect.describe()}"]
    problems: list[str] = []
    if status == 200:
        if not case.expect.ok:
            problems.append(f"answered 200, expected {case.expect.describe()}: {body[:300]!r}")
        if case.kind in ("chat", "completion"):
            streamed = headers.get("content-type", "").startswith("text/event-stream")
            if streamed != case.stream:
                problems.append(f"answered with content-type {headers.get('content-type')!r}")
            if streamed:
                found, texts = check_stream(case, body)
            else:
                found, texts = check_generation(case, body)
            problems += found
            if case.reference is not None and references is not None and texts:
                want = references.get(case.reference)
                if want is not None and texts[0] != want:
                    problems.append(f"text {texts[0]!r} is not the greedy reference {want!r}")
        elif case.kind == "responses":
            from tests.fuzz.responses import check_responses_200  # it builds on this module

            problems += check_responses_200(case, headers, body)
        elif case.kind == "messages":
            from tests.fuzz.messages import check_messages_200  # it builds on this module

            problems += check_messages_200(case, headers, body)
        else:
            problems += check_other_200(case, headers, body)
        return problems
    if 400 <= status < 500 and case.kind == "messages":
        found, error = check_anthropic_error_body(status, body)
        problems += found
        if status not in case.expect.errors:
            problems.append(f"answered {status}, expected {case.expect.describe()}: {body[:300]!r}")
        elif error is not None and case.expect.params is not None:
            named = message_names(error["message"], case.expect.params)
            if not (named is None and case.expect.null_param_ok) and not named:
                names = "/".join(sorted(case.expect.params))
                problems.append(f"{status} message names no {names}: {error['message'][:200]!r}")
        return problems
    if 400 <= status < 500:
        found, error = check_error_body(status, body)
        problems += found
        if status not in case.expect.errors:
            problems.append(f"answered {status}, expected {case.expect.describe()}: {body[:300]!r}")
        elif error is not None and case.expect.params is not None:
            param = error.get("param")
            if not (param is None and case.expect.null_param_ok) and not param_matches(
                param, case.expect.params
            ):
                problems.append(
                    f"{status} names param {param!r}, expected {case.expect.describe()}: "
                    f"{error.get('message', '')[:200]!r}"
                )
        return problems
    return [f"answered {status}, expected {case.expect.describe()}: {body[:300]!r}"]
