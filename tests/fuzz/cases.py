"""The fuzz corpus: what each case expects (:class:`Expect`), request bodies with raw JSON
(:class:`Raw`), and the seeded generators (:func:`generate_cases`, :func:`bound_cases`) over
the data of ``corpus.json``; the rules of which fault names which ``param`` are in
:mod:`tests.fuzz`."""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

# SmolLM2's vocabulary has 49152 tokens; ids 0-16 are special tokens.
VOCAB_SIZE = 49152
OUT_OF_VOCAB = 10**6
# The bound of ``n`` by default (--max-seqs-per-batch's default, 64).
DEFAULT_MAX_N = 64
# Comfortably above the default request body limit ("a few MB").
HUGE_BODY_BYTES = 16 * 1024 * 1024
# Nesting no sane limit allows but Python's json parser still takes (it gives up near 1000)...
DEEP = 900
# ...and nesting it does not take (then a 400 may come before any field is known).
TOO_DEEP = 5000

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}


# --- what a case expects -------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What a correct server answers a case.

    Attributes:
        ok: a 200 is correct.
        errors: the 4xx statuses that are correct.
        params: when not ``None``, a 4xx must name one of these fields (prefix match).
        null_param_ok: a 4xx may also have ``param: null`` (only with ``params``).
    """

    ok: bool = True
    errors: frozenset[int] = frozenset()
    params: frozenset[str] | None = None
    null_param_ok: bool = False

    def describe(self) -> str:
        errors = ["any 4xx"] if self.errors == ALL_4XX else [str(s) for s in sorted(self.errors)]
        allowed = (["200"] if self.ok else []) + errors
        text = " or ".join(allowed)
        if self.params is not None:
            text += f" (a 4xx naming {'/'.join(sorted(self.params))}"
            text += " or no param)" if self.null_param_ok else ")"
        return text


OK = Expect()
ALL_4XX = frozenset(range(400, 500))
# Any non-5xx answer: a 200 or any 4xx with any param (still well formed).
ANY = Expect(ok=True, errors=ALL_4XX)


def bad(*params: str, statuses=(400,), null_ok: bool = False) -> Expect:
    """A 4xx (``statuses``) naming one of ``params``."""
    return Expect(False, frozenset(statuses), frozenset(params), null_ok)


def ok_or_bad(*params: str, statuses=(400,)) -> Expect:
    """A 200, or a 4xx (``statuses``) naming one of ``params``: for values a server may take
    or refuse (as long as it does not fail)."""
    return Expect(True, frozenset(statuses), frozenset(params))


def any_error(*statuses: int) -> Expect:
    """One of ``statuses`` (all 4xx by default), any param."""
    return Expect(False, frozenset(statuses) if statuses else ALL_4XX)


# Top-level fields the corpus sends that no request declares: a 400 naming them (OpenAI's
# contract; the fuzz's server runs without --ignore-unknown-fields).
UNKNOWN_FIELDS = frozenset({"metadata", "unknown_field"})


def with_unknown_fields(expect: Expect, names: list[str]) -> Expect:
    """``expect`` for a body that also holds the unknown fields ``names``: a 400 naming one of
    them, or what ``expect`` allows (its fault may be found first); a case whose answer cannot
    be a 400 (a 413 for its size, a 405) is left as it is."""
    if not names or not (expect.ok or 400 in expect.errors):
        return expect
    if expect.params is not None:
        params = expect.params | frozenset(names)
    elif expect.errors:  # any 4xx was fine already
        params = None
    else:  # a valid body: the unknown field is its fault
        params = frozenset(names)
    return replace(expect, ok=False, errors=expect.errors | {400}, params=params)


# --- request bodies ---------------------------------------------------------------------------


class Raw:
    """JSON text put verbatim into a body (``NaN``, ``-0``, ``1e400``, raw invalid UTF-8 bytes,
    nesting too deep for ``json.dumps``); as a dict key it must include its quotes."""

    def __init__(self, text: bytes | str):
        self.text = text.encode("latin-1") if isinstance(text, str) else text

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 40 else self.text[:37] + b"..."
        return f"Raw({shown!r})"


def encode_body(obj) -> bytes:
    """``obj`` as JSON bytes (ASCII: lone surrogates become ``\\udfff`` escapes), with each
    :class:`Raw` value or key replaced by its text."""
    raws: list[bytes] = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {mark(k) if isinstance(k, Raw) else k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(obj), ensure_ascii=True, allow_nan=True).encode("ascii")
    for i, raw in enumerate(raws):
        text = text.replace(f'"\\u0000RAW{i}\\u0000"'.encode(), raw, 1)
    return text


def nested(depth: int, leaf: str = "[]", kind: str = "list") -> Raw:
    """``depth`` nested JSON lists (``[[[...]]]``) or objects (``{"a": {"a": ...}}``)."""
    if kind == "list":
        return Raw("[" * depth + leaf + "]" * depth)
    return Raw('{"a": ' * depth + leaf + "}" * depth)


@dataclass
class Case:
    """One request of the corpus and what a correct server answers it.

    ``n`` is the number of choices a 200 of a generation request has; ``echo`` says the first
    logprob of each completion choice may be null; ``reference`` (when set) is the body of a
    greedy request whose text a 200 must equal exactly.
    """

    id: int
    label: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    expect: Expect = OK
    kind: str = "other"
    stream: bool = False
    n: int = 1
    echo: bool = False
    include_usage: bool = False
    chunked: bool = False
    reference: bytes | None = None

    def describe(self, limit: int = 600) -> str:
        body = self.body or b""
        if len(body) > limit:
            shown = f"{body[: limit // 2]!r} ... {body[-limit // 4 :]!r} ({len(body)} bytes)"
        else:
            shown = repr(body)
        chunked = ", sent chunked" if self.chunked else ""
        return (
            f"case #{self.id} [{self.label}]: {self.method} {self.path} "
            f"headers={self.headers} body={shown}{chunked}"
        )

    def repro(self, base_url: str) -> str:
        """A Python line that sends this request (the body cut short when it is long)."""
        body = self.body or b""
        if len(body) > 2000:
            return f"# {len(body)} bytes: regenerate it with PYXLLM_FUZZ_CASES={self.id}"
        return (
            f"httpx.request({self.method!r}, {base_url + self.path!r}, "
            f"headers={self.headers!r}, content={body!r}, timeout=60)"
        )


# --- generating the corpus -------------------------------------------------------------------

CORPUS_FILE = Path(__file__).with_name("corpus.json")


def _expand(value):
    """A value of :data:`CORPUS_FILE` with its markers replaced: ``{"$raw": text, "times": k}``
    a :class:`Raw` (text repeated k times, sent as is), ``{"$string_of": s, "times": k,
    "prefix": p}`` and ``{"$list_of": v, "times": k}`` repetitions, ``{"$range": k}`` the list
    0..k-1."""
    if isinstance(value, list):
        return [_expand(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$raw" in value:
        return Raw(value["$raw"] * value.get("times", 1))
    if "$string_of" in value:
        return value.get("prefix", "") + value["$string_of"] * value["times"]
    if "$list_of" in value:
        return [value["$list_of"]] * value["times"]
    if "$range" in value:
        return list(range(value["$range"]))
    return {k: _expand(v) for k, v in value.items()}


_CORPUS = _expand(json.loads(CORPUS_FILE.read_text()))
PROMPTS: list[str] = _CORPUS["prompts"]
WORDS: list[str] = _CORPUS["words"]
TOOL: dict = _CORPUS["tool"]
# (field, value) pairs: constraints a server compiles; ones it refuses with a 400 naming the
# field; valid but huge or odd ones (a 200 or a 400 naming the field, never a 5xx or a hang)
VALID_CONSTRAINTS: list[tuple[str, object]] = [tuple(x) for x in _CORPUS["valid_constraints"]]
INVALID_CONSTRAINTS: list[tuple[str, object]] = [tuple(x) for x in _CORPUS["invalid_constraints"]]
EXTREME_CONSTRAINTS: list[tuple[str, object]] = [tuple(x) for x in _CORPUS["extreme_constraints"]]
UNUSUAL_UNICODE: list[str] = _CORPUS["unusual_unicode"]
# chat_template_kwargs that clash with apply_chat_template's own arguments: a 200 or a 400
# naming chat_template_kwargs (the fault is there, not in messages).
TEMPLATE_KWARGS: list[dict] = _CORPUS["template_kwargs"]
SURROGATES: list[str] = _CORPUS["surrogates"]
INVALID_UTF8: list[bytes] = [bytes.fromhex(h) for h in _CORPUS["invalid_utf8_hex"]]
# Wrong values per declared type, the declared types of each endpoint's fields, and other
# fields' wrong values (each a 400 naming the field).
WRONG: dict[str, list] = _CORPUS["wrong_values_by_type"]
COMMON_TYPES: dict[str, str] = _CORPUS["common_types"]
CHAT_TYPES = {**COMMON_TYPES, **_CORPUS["chat_types"]}
COMPLETION_TYPES = {**COMMON_TYPES, **_CORPUS["completion_types"]}
WRONG_SHAPES: dict[str, list] = _CORPUS["wrong_shapes"]
# Fields a beam search (use_beam_search) is refused with (beside the constraint fields), and
# the beam width, n.
BEAM_SEARCH_CONFLICTS: tuple[str, ...] = tuple(_CORPUS["beam_search_conflicts"])


def _expectation(kind: str, name: str) -> Expect:
    """The :class:`Expect` a corpus row names by ``kind`` for the field ``name``."""
    if kind == "ok":
        return OK
    if kind == "bad":
        return bad(name)
    if kind == "bad_or_null":
        return bad(name, null_ok=True)
    if kind == "ok_or_bad":
        return ok_or_bad(name)
    if kind == "ok_or_bad_beam_search":
        return ok_or_bad(name, *BEAM_SEARCH_CONFLICTS)
    raise ValueError(f"{CORPUS_FILE.name}: unknown expectation {kind!r} for {name}")


def _faults(rows: list) -> list[tuple[str, object, Expect]]:
    """``(field, value, expect)`` of each value of rows ``[field, expectation, [values...]]``."""
    return [(name, v, _expectation(kind, name)) for name, kind, values in rows for v in values]


# (field, value, expect) of values in a type pydantic's lax mode may convert.
_LAX = _CORPUS["lax_values"]
_LAX_COMMON = [(f, v, _expectation(kind, f)) for f, v, kind in _LAX["common"]]
LAX_VALUES = {
    kind: _LAX_COMMON + [(f, v, _expectation(e, f)) for f, v, e in _LAX[kind]]
    for kind in ("chat", "completion")
}
# (field, value, expect) of numbers out of range or extreme, for chat and completions.
NUMBER_FAULTS = _faults(_CORPUS["number_faults"])
CHAT_NUMBER_FAULTS = _faults(_CORPUS["chat_number_faults"])
COMPLETION_NUMBER_FAULTS = _faults(_CORPUS["completion_number_faults"])


def _prompt(rng: random.Random) -> str:
    return rng.choice(PROMPTS)


def _messages(rng: random.Random) -> list[dict]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are brief."})
    if rng.random() < 0.2:
        messages += [
            {"role": "user", "content": rng.choice(WORDS)},
            {"role": "assistant", "content": rng.choice(["Sure.", "4", "Blue."])},
        ]
    if rng.random() < 0.1:
        call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        messages += [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    content = rng.choice(WORDS + PROMPTS[:8])
    if rng.random() < 0.2:
        content = [{"type": "text", "text": content}, {"type": "text", "text": "Thanks."}]
    user = {"role": "user", "content": content}
    if rng.random() < 0.1:
        user["name"] = "alice"
    messages.append(user)
    return messages


@dataclass
class _Draft:
    """A request body being generated, with what its answer looks like."""

    kind: str  # chat or completion
    body: dict
    expect: Expect = OK
    label: str = "valid"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    raw: bytes | None = None  # the body, when it is not ``encode_body(body)``
    chunked: bool = False
    reference: dict | None = None

    @property
    def path(self) -> str:
        return CHAT_PATH if self.kind == "chat" else COMPLETIONS_PATH


def _valid_sampling(rng: random.Random, body: dict, kind: str) -> None:
    """Random valid sampling fields (any combination of them is valid)."""
    maybe = rng.random
    max_tokens = rng.randint(1, 4)
    if kind == "chat" and maybe() < 0.2:
        body["max_completion_tokens"] = max_tokens
        if maybe() < 0.5:
            body["max_tokens"] = rng.randint(1, 4)
    else:
        body["max_tokens"] = max_tokens
    if maybe() < 0.25:
        body["n"] = rng.randint(1, 3)
        if maybe() < 0.3:
            body["best_of"] = body["n"]
    if maybe() < 0.5:
        body["temperature"] = rng.choice([0, 0.0, 0.5, 1, 1.3, 2.0, None])
    if maybe() < 0.2:
        body["top_p"] = rng.choice([0.1, 0.5, 0.9, 1, 1e-46, 5e-324, None])
    if maybe() < 0.15:
        body["top_k"] = rng.choice([-1, 0, 1, 5, 50, None])
    if maybe() < 0.1:
        body["min_p"] = rng.choice([0, 0.05, 0.5, None])
    if maybe() < 0.1:
        body["presence_penalty"] = rng.uniform(-2, 2)
    if maybe() < 0.1:
        body["frequency_penalty"] = rng.uniform(-2, 2)
    if maybe() < 0.1:
        body["repetition_penalty"] = rng.choice([0.5, 1.0, 1.2, 2.0])
    if maybe() < 0.3:
        body["seed"] = rng.choice([0, 1, 42, 2**31, 2**63 - 1, rng.randrange(2**32)])
    if maybe() < 0.2:
        body["stop"] = rng.choice(
            [".", "\n", "", [], [" ", "e"], ["a", "b", "c", "d"], "😀", [""], None]
        )
    if maybe() < 0.1:
        body["stop_token_ids"] = rng.choice([[2], [0, 1, 2], [1000], []])
    if maybe() < 0.1:
        body["include_stop_str_in_output"] = rng.random() < 0.5
    if maybe() < 0.15:
        body["logit_bias"] = {str(rng.randrange(VOCAB_SIZE)): rng.uniform(-100, 100)}
        if maybe() < 0.3:
            body["logit_bias"] = {"198": -100, "30": 100, "5": 0}
    if maybe() < 0.1:
        body["ignore_eos"] = True
    if maybe() < 0.1:
        body["min_tokens"] = rng.randint(0, 1)
    if maybe() < 0.1:
        body["skip_special_tokens"] = rng.random() < 0.5
    if maybe() < 0.05:
        body["user"] = rng.choice(["alice", "", "ü" * 50])
    if maybe() < 0.05:
        body["metadata"] = {"trace": "x", "depth": [[{"a": [1]}]]}
    if maybe() < 0.05:
        body["unknown_field"] = rng.choice([1, "x", None, [1, 2], {"k": "v"}])
    if maybe() < 0.3:
        body["stream"] = True
        if maybe() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.7}
    elif maybe() < 0.1:
        body["stream"] = False


def _chat_body(rng: random.Random, model: str) -> _Draft:
    body: dict = {"messages": _messages(rng)}
    if rng.random() < 0.7:
        body["model"] = model
    _valid_sampling(rng, body, "chat")
    draft = _Draft("chat", body)
    if rng.random() < 0.2:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.randint(0, 3)
    elif rng.random() < 0.05:
        body["logprobs"] = False
    if rng.random() < 0.05:
        body["add_generation_prompt"] = rng.random() < 0.5
    if rng.random() < 0.05:
        body["chat_template_kwargs"] = rng.choice(
            [{}, {"add_generation_prompt": True}, {"enable_thinking": False}, {"x": [1, {"y": 2}]}]
        )
    roll = rng.random()
    if roll < 0.12:
        name, value = rng.choice(VALID_CONSTRAINTS)
        body[name] = value
    elif roll < 0.2:
        body["tools"] = [TOOL]
        body["tool_choice"] = rng.choice(
            ["required", "none", {"type": "function", "function": {"name": "get_weather"}}]
        )
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = rng.random() < 0.5
    _risky_combinations(draft)
    return draft


def _completion_body(rng: random.Random, model: str) -> _Draft:
    roll = rng.random()
    if roll < 0.6:
        prompt: object = _prompt(rng)
    elif roll < 0.75:
        prompt = [_prompt(rng)]
    elif roll < 0.9:
        prompt = [rng.randrange(17, 20000) for _ in range(rng.randint(1, 8))]
    else:
        prompt = [[rng.randrange(17, 20000) for _ in range(rng.randint(1, 8))]]
    body: dict = {"prompt": prompt}
    if rng.random() < 0.7:
        body["model"] = model
    _valid_sampling(rng, body, "completion")
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["echo"] = True
    if rng.random() < 0.08:
        name, value = rng.choice(VALID_CONSTRAINTS)
        body[name] = value
    draft = _Draft("completion", body)
    _risky_combinations(draft)
    return draft


_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _constrained(body: dict) -> bool:
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        return any(body.get(f) is not None for f in _CONSTRAINT_FIELDS[1:])
    tool_choice = body.get("tool_choice")
    return any(body.get(f) is not None for f in _CONSTRAINT_FIELDS) or (
        body.get("tools") is not None and tool_choice not in (None, "none")
    )


def _risky_combinations(draft: _Draft) -> None:
    """Valid fields whose combination a server may refuse: a constraint with ``min_tokens``,
    ``ignore_eos`` or stop token ids (the constraint may want EOS where they forbid it)."""
    body = draft.body
    if _constrained(body) and (
        body.get("min_tokens") or body.get("ignore_eos") or body.get("stop_token_ids")
    ):
        draft.expect, draft.label = ANY, "constraint with min_tokens/ignore_eos/stop_token_ids"


def _string_slots(body: dict, kind: str) -> list[tuple[str, Callable[[object], None]]]:
    """``(top-level field, setter)`` of string places in ``body`` where a value can go."""
    slots: list[tuple[str, Callable[[object], None]]] = []

    def setter(container, key):
        def put(value):
            container[key] = value

        return put

    slots.append(("model", setter(body, "model")))
    slots.append(("user", setter(body, "user")))
    slots.append(("stop", setter(body, "stop")))
    slots.append(("metadata", lambda v: body.__setitem__("metadata", {"note": v})))
    slots.append(("logit_bias", lambda v: body.__setitem__("logit_bias", {v: 1})))
    slots.append(("stop", lambda v: body.__setitem__("stop", ["ok", v])))
    if kind == "chat":
        for i, message in enumerate(body.get("messages", [])):
            if isinstance(message.get("content"), str):
                slots.append(("messages", setter(message, "content")))
            elif isinstance(message.get("content"), list):
                slots.append(("messages", setter(message["content"][0], "text")))
            slots.append(("messages", setter(message, "name")))
            if i == 0:
                slots.append(("messages", setter(message, "role")))
        slots.append(
            ("chat_template_kwargs", lambda v: body.__setitem__("chat_template_kwargs", {"x": v}))
        )
        slots.append(
            ("chat_template_kwargs", lambda v: body.__setitem__("chat_template_kwargs", {v: 1}))
        )
        slots.append(("guided_choice", lambda v: body.__setitem__("guided_choice", ["a", v])))
        slots.append(
            (
                "structured_outputs",
                lambda v: body.__setitem__("structured_outputs", {"regex": v}),
            )
        )
        slots.append(
            (
                "tools",
                lambda v: body.update(
                    tools=[{**TOOL, "function": {**TOOL["function"], "description": v}}],
                    tool_choice="none",
                ),
            )
        )
    else:
        slots.append(("prompt", setter(body, "prompt")))
        slots.append(("prompt", lambda v: body.__setitem__("prompt", [v])))
        slots.append(("guided_regex", setter(body, "guided_regex")))
    return slots


def _prepare(body: dict, name: str) -> None:
    """Remove what would hide a fault put into field ``name`` or fail first: the other output
    constraints (for a constraint field), ``best_of`` (for ``n``), ``max_completion_tokens``
    (which overrides ``max_tokens``)."""
    if name in _CONSTRAINT_FIELDS or name in ("tools", "tool_choice"):
        for other in _CONSTRAINT_FIELDS + ("tools", "tool_choice"):
            body.pop(other, None)
    if name == "n":
        body.pop("best_of", None)
    if name in ("max_tokens", "min_tokens"):
        body.pop("max_completion_tokens", None)
        body.pop("echo", None)  # echo with max_tokens 0 is the prompt alone
    if name == "max_completion_tokens":
        body.pop("max_tokens", None)


def _fault(rng: random.Random, draft: _Draft) -> None:
    """Put one fault into ``draft`` and say what a correct server answers."""
    body, kind = draft.body, draft.kind
    roll = rng.random()
    if roll < 0.2:  # wrong type of one field
        types = CHAT_TYPES if kind == "chat" else COMPLETION_TYPES
        shapes = [k for k in WRONG_SHAPES if kind == "chat" or k != "chat_template_kwargs"]
        name = rng.choice(sorted(types) + sorted(shapes))
        values = WRONG_SHAPES.get(name) or WRONG[types[name]]
        value = rng.choice(values)
        _prepare(body, name)
        body[name] = value
        if name == "stream_options":
            body["stream"] = True
        draft.expect, draft.label = bad(name), f"wrong type: {name}={value!r}"
    elif roll < 0.42:  # an out-of-range or extreme number
        faults = NUMBER_FAULTS + (
            CHAT_NUMBER_FAULTS if kind == "chat" else COMPLETION_NUMBER_FAULTS
        )
        name, value, expect = rng.choice(faults)
        _prepare(body, name)
        body[name] = value
        if name == "min_tokens" and value == 50:
            body["max_tokens"] = 4
        if name == "best_of" and body.get("n", 1) == value:
            body["n"] = 1
        if name == "top_logprobs":
            body["logprobs"] = True
        if isinstance(value, float) and not math.isfinite(value):
            # NaN and Infinity are not JSON: a server may refuse them as it parses the body
            expect = replace(expect, null_param_ok=True)
        draft.expect, draft.label = expect, f"number: {name}={value!r}"
    elif roll < 0.55:  # a lone surrogate (JSON escape) in one string
        name, put = rng.choice(_string_slots(body, kind))
        _prepare(body, name)
        put(rng.choice(SURROGATES))
        draft.expect, draft.label = bad(name), f"lone surrogate escape in {name}"
    elif roll < 0.63:  # raw invalid UTF-8 bytes in one string
        name, put = rng.choice(_string_slots(body, kind))
        _prepare(body, name)
        raw = rng.choice(INVALID_UTF8)
        quoted = b'"ok' + raw + b'"'
        put(Raw(quoted))
        draft.expect, draft.label = bad(name, null_ok=True), f"raw bytes {raw!r} in {name}"
    elif roll < 0.68:  # valid but unusual Unicode: served
        text = rng.choice(UNUSUAL_UNICODE)
        if kind == "chat":
            body["messages"][-1]["content"] = text
        elif rng.random() < 0.5:
            body["prompt"] = text
        else:
            body["user"] = text
        draft.label = f"valid unusual Unicode {text!r}"
    elif roll < 0.76:  # structured outputs and tools
        _constraint_fault(rng, draft)
    elif roll < 0.8:  # constraints too big or odd to compile, or fine
        name, value = rng.choice(EXTREME_CONSTRAINTS)
        _prepare(body, name)
        body[name] = value
        draft.expect, draft.label = ok_or_bad(name), f"extreme constraint: {name}={value!r}"[:120]
        _risky_combinations(draft)
    elif roll < 0.84:  # values pydantic's lax mode may take ("3" for an int)
        name, value, expect = rng.choice(LAX_VALUES[kind])
        _prepare(body, name)
        body[name] = value
        draft.expect, draft.label = expect, f"lax value: {name}={value!r}"
        if expect is OK:
            _risky_combinations(draft)
    elif roll < 0.92:  # field-specific faults
        (_chat_fault if kind == "chat" else _completion_fault)(rng, draft)
    else:  # combinations of valid fields that conflict
        _conflict_fault(rng, draft)


def _constraint_fault(rng: random.Random, draft: _Draft) -> None:
    body = draft.body
    for name in _CONSTRAINT_FIELDS + ("tools", "tool_choice"):
        body.pop(name, None)
    roll = rng.random()
    if roll < 0.5 or draft.kind != "chat":
        name, value = rng.choice(INVALID_CONSTRAINTS)
        body[name] = value
        draft.expect, draft.label = bad(name), f"invalid constraint: {name}={value!r}"
    elif roll < 0.6:
        (a, va), (b, vb) = rng.sample([c for c in VALID_CONSTRAINTS if c[1] != {"type": "text"}], 2)
        if a == b:
            draft.label = "valid constraint"
            body[a] = va
            return
        body[a], body[b] = va, vb
        draft.expect, draft.label = bad(a, b), f"two constraints: {a} and {b}"
    else:
        faults = [
            ({"tools": "x"}, ("tools",)),
            ({"tools": [{"type": "function"}]}, ("tools",)),
            ({"tools": [{"type": "function", "function": {"name": 5}}]}, ("tools",)),
            ({"tools": [{"type": "magic", "function": {"name": "f"}}]}, ("tools",)),
            ({"tools": [TOOL, TOOL], "tool_choice": "required"}, ("tools",)),
            (
                {
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "nonsense"}},
                        }
                    ],
                    "tool_choice": "required",
                },
                ("tools",),
            ),
            ({"tool_choice": "required"}, ("tool_choice",)),
            # "auto" (the default with tools): the parser the chat template calls for serves it
            ({"tools": [TOOL], "tool_choice": "auto"}, None),
            ({"tools": [TOOL]}, None),
            ({"tools": [TOOL], "tool_choice": "maybe"}, ("tool_choice",)),
            (
                {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                ("tool_choice",),
            ),
            (
                {  # (OpenAI's response_format beside a forced call is served)
                    "tools": [TOOL],
                    "tool_choice": "required",
                    "structured_outputs": {"regex": "a+"},
                },
                ("structured_outputs", "tools", "tool_choice"),
            ),
        ]
        fields, params = rng.choice(faults)
        body.update(fields)
        if params is None:
            draft.expect, draft.label = OK, f"auto tool choice: {fields!r}"[:120]
            _risky_combinations(draft)
        else:
            draft.expect, draft.label = bad(*params), f"tool fault: {fields!r}"[:120]


def _chat_fault(rng: random.Random, draft: _Draft) -> None:
    body = draft.body
    faults = [
        ({"messages": []}, bad("messages")),
        ({"messages": "Hello"}, bad("messages")),
        ({"messages": {}}, bad("messages")),
        ({"messages": [1]}, bad("messages")),
        ({"messages": [{"content": "x"}]}, bad("messages")),
        ({"messages": [{"role": 5, "content": "x"}]}, bad("messages")),
        ({"messages": [{"role": "user", "content": 5}]}, bad("messages")),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, bad("messages")),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, bad("messages")),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, bad("messages")),
        ({"messages": [{"role": "tool", "content": "x"}]}, bad("messages")),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": "x"}]}, bad("messages")),
        ({"messages": [{"role": "", "content": "x"}]}, ok_or_bad("messages")),
        ({"messages": [{"role": "robot", "content": "x"}]}, ok_or_bad("messages")),
        ({"messages": [{"role": "user", "content": None}]}, ok_or_bad("messages")),
        ({"messages": [{"role": "user", "content": ""}]}, OK),
        ({"messages": [{"role": "user", "content": "hello " * 3000}]}, bad("messages")),
        ({"stream_options": {"include_usage": True}, "stream": False}, bad("stream_options")),
        (
            {"stream_options": {"continuous_usage_stats": True}, "stream": True},
            bad("stream_options"),
        ),
        ({"top_logprobs": 2, "logprobs": False}, bad("top_logprobs")),
        ({"chat_template": "{{ messages[0]['content'] }}"}, bad("chat_template")),
        (
            {"chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"}},
            bad("chat_template_kwargs"),
        ),
        ({"model": ""}, ok_or_bad("model", statuses=(400, 404))),
        ({"model": "gpt-4o"}, bad("model", statuses=(404,))),
        ({"model": "x" * 5000}, bad("model", statuses=(404,))),
        ({"chat_template_kwargs": {"x": nested(20)}}, OK),
        ({"chat_template_kwargs": {"x": nested(200)}}, ok_or_bad("chat_template_kwargs")),
        *(
            ({"chat_template_kwargs": kw}, ok_or_bad("chat_template_kwargs"))
            for kw in TEMPLATE_KWARGS
        ),
    ]
    fields, expect = rng.choice(faults)
    body.update(fields)
    if "messages" in fields and expect is OK:
        body.pop("chat_template_kwargs", None)
    draft.expect, draft.label = expect, f"chat: {fields!r}"[:120]


def _completion_fault(rng: random.Random, draft: _Draft) -> None:
    body = draft.body
    faults = [
        ({"prompt": 42}, bad("prompt")),
        ({"prompt": {}}, bad("prompt")),
        ({"prompt": None}, bad("prompt")),
        ({"prompt": ""}, bad("prompt")),
        ({"prompt": []}, bad("prompt")),
        ({"prompt": [[]]}, bad("prompt")),
        ({"prompt": [1.5]}, bad("prompt")),
        ({"prompt": [[1, "a"]]}, bad("prompt")),
        ({"prompt": [-1]}, bad("prompt")),
        ({"prompt": [2**64]}, bad("prompt")),
        ({"prompt": [OUT_OF_VOCAB]}, bad("prompt")),
        ({"prompt": [VOCAB_SIZE]}, bad("prompt")),
        ({"prompt": ["a", "b"]}, bad("prompt")),
        ({"prompt": [[1], [2]]}, bad("prompt")),
        ({"prompt": "hello " * 3000}, bad("prompt")),
        ({"prompt": list(range(100, 700))}, bad("prompt")),
        ({"prompt": ["a"] * 1000}, bad("prompt")),
        ({"echo": True, "logprobs": 2}, OK),
        ({"echo": True, "max_tokens": 0}, OK),
        ({"echo": True, "max_tokens": 0, "logprobs": 1, "stream": True}, OK),
        ({"echo": True, "max_tokens": 1, "logprobs": 0}, OK),
        ({"stream_options": {"include_usage": True}, "stream": False}, bad("stream_options")),
        ({"suffix": "tail"}, bad("suffix")),
        ({"model": "gpt-4o"}, bad("model", statuses=(404,))),
        ({"model": ""}, ok_or_bad("model", statuses=(400, 404))),
    ]
    fields, expect = rng.choice(faults)
    body.update(fields)
    if body.get("echo") and expect is OK:
        body.pop("min_tokens", None)
        if body.get("max_tokens") == 0:
            body.pop("best_of", None)
            _risky_combinations(draft)
            expect = draft.expect
    draft.expect, draft.label = expect, f"completion: {fields!r}"[:120]


def _conflict_fault(rng: random.Random, draft: _Draft) -> None:
    body = draft.body
    body.pop("max_completion_tokens", None)
    body.pop("best_of", None)
    faults = [
        ({"min_tokens": 4, "max_tokens": 2}, bad("min_tokens")),
        ({"best_of": 3, "n": 2}, bad("best_of")),
        ({"stream": False, "stream_options": {"include_usage": False}}, bad("stream_options")),
        ({"n": 3, "stream": True, "seed": 7}, OK),
        ({"n": 2, "stream": True, "stop": ["a", "e"], "max_tokens": 4}, OK),
        ({"n": 2, "temperature": 0, "seed": 2**63 - 1}, OK),
        ({"stop": ["x"] * 64}, ok_or_bad("stop")),
    ]
    fields, expect = rng.choice(faults)
    body.update(fields)
    if expect is OK:
        body.pop("min_tokens", None)
        _risky_combinations(draft)
        expect = draft.expect
    draft.expect, draft.label = expect, f"combination: {fields!r}"[:120]


def _encoding_fault(rng: random.Random, draft: _Draft) -> None:
    """Invalid JSON, a body that is not an object, or a wrong content type."""
    body = encode_body(draft.body)
    faults: list[tuple[bytes, dict[str, str], Expect, str]] = [
        (body[:-1], JSON_HEADERS, any_error(400), "truncated JSON"),
        (body[: len(body) // 2], JSON_HEADERS, any_error(400), "JSON cut in half"),
        (body[:-1] + b",}", JSON_HEADERS, any_error(400), "trailing comma"),
        (body.replace(b'"', b"'"), JSON_HEADERS, any_error(400), "single quotes"),
        (body + b" garbage", JSON_HEADERS, any_error(400), "trailing garbage"),
        (b"", JSON_HEADERS, any_error(400), "empty body"),
        (b"null", JSON_HEADERS, any_error(400), "null body"),
        (b"[]", JSON_HEADERS, any_error(400), "array body"),
        (b"[" + body + b"]", JSON_HEADERS, any_error(400), "object in an array"),
        (b"123", JSON_HEADERS, any_error(400), "number body"),
        (b'"hi"', JSON_HEADERS, any_error(400), "string body"),
        (b"{", JSON_HEADERS, any_error(400), "lone brace"),
        (b"\x00\x01\x02", JSON_HEADERS, any_error(400), "binary body"),
        (b'{"prompt": "a\x01b"}', JSON_HEADERS, any_error(400), "raw control char"),
        (b"\xff" + body, JSON_HEADERS, any_error(400), "leading invalid byte"),
        (body.replace(b":", b":\xff", 1), JSON_HEADERS, any_error(400), "invalid byte in JSON"),
        (b"{" * 100000, JSON_HEADERS, any_error(400, 413), "100000 open braces"),
        (body, {"content-type": "text/plain"}, ANY, "text/plain"),
        (body, {}, ANY, "no content-type"),
        (body, {"content-type": "application/x-www-form-urlencoded"}, ANY, "form content-type"),
        (body, {"content-type": "multipart/form-data; boundary=x"}, ANY, "multipart"),
        (body, {"content-type": "application/json; charset=latin-1"}, ANY, "latin-1 charset"),
        (body, {"content-type": "application/vnd.api+json"}, ANY, "+json"),
        (body, {"content-type": "APPLICATION/JSON"}, ANY, "upper-case content-type"),
        (b"\xef\xbb\xbf" + body, JSON_HEADERS, ANY, "UTF-8 BOM"),
        (
            json.dumps(draft.body, ensure_ascii=False).encode("utf-16"),
            JSON_HEADERS,
            ANY,
            "UTF-16 body",
        ),
        (body[:-1] + b', "model": 5}', JSON_HEADERS, ANY, "duplicate key"),
        (body, {**JSON_HEADERS, "content-encoding": "gzip"}, ANY, "gzip encoding, not gzipped"),
        (gzip.compress(body), {**JSON_HEADERS, "content-encoding": "gzip"}, ANY, "gzipped body"),
        (body, {**JSON_HEADERS, "expect": "100-continue"}, OK, "Expect: 100-continue"),
        (body, {**JSON_HEADERS, "x-junk": b"\xe9" * 100}, OK, "a non-ASCII header"),
    ]
    raw, headers, expect, label = rng.choice(faults)
    draft.raw, draft.headers, draft.expect, draft.label = raw, dict(headers), expect, label
    if expect is OK:
        _risky_combinations(draft)
    elif expect is ANY:
        # the body is valid: a 200 means it was served as it is
        _risky_combinations(draft)
        draft.expect = ANY


# --- other routes ---------------------------------------------------------------------------

GET_ROUTES: list[str] = _CORPUS["get_routes"]
POST_ROUTES = [CHAT_PATH, COMPLETIONS_PATH, "/tokenize", "/detokenize"]
UNKNOWN_ROUTES: list[str] = _CORPUS["unknown_routes"]


def _tokenize_case(rng: random.Random, model: str) -> _Draft:
    body: dict = {}
    if rng.random() < 0.5:
        body["prompt"] = rng.choice(PROMPTS + WORDS)
    else:
        body["messages"] = _messages(rng)
        if rng.random() < 0.3:
            body["add_generation_prompt"] = rng.random() < 0.5
    if rng.random() < 0.5:
        body["model"] = model
    if rng.random() < 0.3:
        body["add_special_tokens"] = rng.random() < 0.5
    if rng.random() < 0.3:
        body["return_token_strs"] = rng.random() < 0.5
    draft = _Draft("tokenize", body, label="tokenize")
    if rng.random() < 0.55:
        faults = [
            ({"prompt": 5}, bad("prompt")),
            ({"prompt": ["a"]}, bad("prompt")),
            ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, None),
            ({"messages": "x"}, bad("messages")),
            ({"messages": [{"role": "user"}]}, ok_or_bad("messages")),
            ({"messages": [{"content": "x"}]}, bad("messages")),
            ({"add_special_tokens": "x"}, bad("add_special_tokens")),
            ({"return_token_strs": []}, bad("return_token_strs")),
            ({"model": "other"}, bad("model", statuses=(404,))),
            ({"model": 5}, bad("model")),
            ({"prompt": "x" * 100_000}, ok_or_bad("prompt")),
            ({"prompt": "\udfff"}, bad("prompt")),
            ({"prompt": "ok\ud800ok"}, bad("prompt")),
            ({"model": "\udfff"}, bad("model")),
            ({"prompt": Raw(b'"\xed\xa0\x80"')}, bad("prompt", null_ok=True)),
            ({"prompt": Raw(b'"\xff"')}, bad("prompt", null_ok=True)),
            ({"messages": [{"role": "user", "content": "a\udfff"}]}, bad("messages")),
            (
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "chat_template_kwargs": {"chat_template": "{{ 'x' }}"},
                },
                bad("chat_template_kwargs"),
            ),
            (
                {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"},
                ok_or_bad("chat_template"),
            ),
            ({"prompt": "x", "metadata": nested(DEEP)}, bad("metadata", statuses=(400, 413))),
            *(
                (
                    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kw},
                    ok_or_bad("chat_template_kwargs"),
                )
                for kw in TEMPLATE_KWARGS
            ),
        ]
        fields, expect = rng.choice(faults)
        if "prompt" in fields or "messages" in fields:
            body.pop("prompt", None)
            body.pop("messages", None)
        body.update(fields)
        if expect is None:  # both prompt and messages
            expect = bad("prompt", "messages")
        draft.expect, draft.label = expect, f"tokenize: {fields!r}"[:120]
    if "prompt" not in body and "messages" not in body:
        draft.expect, draft.label = bad("prompt", "messages"), "tokenize: neither"
    return draft


def _detokenize_case(rng: random.Random, model: str) -> _Draft:
    body: dict = {"tokens": [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 10))]}
    if rng.random() < 0.5:
        body["model"] = model
    draft = _Draft("detokenize", body, label="detokenize")
    if rng.random() < 0.5:
        faults = [
            ({"tokens": []}, ok_or_bad("tokens")),
            ({"tokens": [-1]}, bad("tokens")),
            ({"tokens": [2**64]}, bad("tokens")),
            ({"tokens": [OUT_OF_VOCAB]}, bad("tokens")),
            ({"tokens": [VOCAB_SIZE]}, bad("tokens")),
            ({"tokens": ["a"]}, bad("tokens")),
            ({"tokens": [1.5]}, bad("tokens")),
            ({"tokens": "x"}, bad("tokens")),
            ({"tokens": None}, bad("tokens")),
            ({"tokens": [[1]]}, bad("tokens")),
            ({"model": "\udfff"}, bad("model")),
            ({"model": "other"}, bad("model", statuses=(404,))),
            ({"tokens": list(range(17, 3000))}, OK),
        ]
        fields, expect = rng.choice(faults)
        body.update(fields)
        draft.expect, draft.label = expect, f"detokenize: {fields!r}"[:120]
    if rng.random() < 0.1:
        del body["tokens"]
        draft.expect, draft.label = bad("tokens"), "detokenize: no tokens"
    return draft


def _route_case(rng: random.Random, model: str) -> tuple[str, str, Expect, str, str]:
    """``(method, path, expect, kind, label)`` of a GET route, a wrong method or an unknown
    route."""
    roll = rng.random()
    query = rng.choice(["", "", "?x=1", "?a=%FF%FE", "?" + "q" * 1000, "?model=\u00e9"])
    if roll < 0.5:
        path = rng.choice(GET_ROUTES)
        kind = {"/v1/models": "models", "/health": "health"}.get(path, path.strip("/"))
        return "GET", path + query, OK, kind.replace("debug/", ""), f"GET {path}"
    if roll < 0.65:
        ident = rng.choice(
            [
                model,
                "gpt-4o",
                "x" * 1000,
                "%ED%A0%80",
                "%FF",
                "a/b/c",
                "%00",
                "\u00e9t\u00e9",
                "%F0%9F%98%80",
            ]
        )
        if ident == model:
            return "GET", f"/v1/models/{ident}", OK, "model", "GET served model"
        return "GET", f"/v1/models/{ident}", bad("model", statuses=(404,)), "error", "GET model"
    if roll < 0.72:
        path = rng.choice(GET_ROUTES + POST_ROUTES + ["/v1/models/" + model, "/nothing"])
        method = rng.choice(["HEAD", "OPTIONS"])
        return method, path, ANY, "error", f"{method} {path}"
    if roll < 0.85:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
        path = rng.choice(POST_ROUTES)
        if method != "GET" or rng.random() < 0.5:
            return method, path, any_error(405), "error", f"{method} {path}"
        path = rng.choice(GET_ROUTES[:4])
        return "POST", path, any_error(405), "error", f"POST {path}"
    path = rng.choice(UNKNOWN_ROUTES)
    return rng.choice(["GET", "POST"]), path + query, any_error(404), "error", "unknown route"


# --- the corpus -------------------------------------------------------------------------------


def _lax_int(value) -> int:
    """``n`` as pydantic's lax mode reads it (1 when it would not)."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return 1


def _lax_true(value) -> bool:
    """A boolean field as pydantic's lax mode reads it."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or (isinstance(value, (int, float)) and value == 1)


def _draft_case(case_id: int, draft: _Draft) -> Case:
    body = draft.body
    if draft.kind in ("chat", "completion") and draft.raw is None and body:
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2  # never the default (up to the context limit)
    raw = draft.raw if draft.raw is not None else encode_body(body)
    n = _lax_int(body.get("n"))
    stream = _lax_true(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    path = {"tokenize": "/tokenize", "detokenize": "/detokenize"}.get(draft.kind, draft.path)
    unknown = []
    if draft.kind in ("chat", "completion") and isinstance(body, dict):
        unknown = sorted(UNKNOWN_FIELDS.intersection(body))
    return Case(
        id=case_id,
        label=draft.label,
        method="POST",
        path=path,
        body=raw,
        headers=draft.headers,
        expect=with_unknown_fields(draft.expect, unknown),
        kind=draft.kind,
        stream=stream,
        n=max(n, 1),
        echo=_lax_true(body.get("echo")),
        include_usage=include_usage,
        chunked=draft.chunked,
        reference=encode_body(draft.reference) if draft.reference is not None else None,
    )


def random_case(rng: random.Random, case_id: int, model: str) -> Case:
    """One random request (about two in three carry one fault)."""
    roll = rng.random()
    if roll < 0.72:
        draft = (_chat_body if roll < 0.38 else _completion_body)(rng, model)
        fault = rng.random()
        if fault < 0.62:
            _fault(rng, draft)
        elif fault < 0.7:
            _encoding_fault(rng, draft)
        elif fault < 0.75:
            draft.chunked, draft.label = True, f"{draft.label}, sent chunked"
        return _draft_case(case_id, draft)
    if roll < 0.8:
        return _draft_case(case_id, _tokenize_case(rng, model))
    if roll < 0.85:
        return _draft_case(case_id, _detokenize_case(rng, model))
    method, path, expect, kind, label = _route_case(rng, model)
    body, headers = None, {}
    if method != "GET" and rng.random() < 0.5:
        body, headers = b'{"prompt": "hi", "max_tokens": 1}', dict(JSON_HEADERS)
    return Case(case_id, label, method, path, body, headers, expect, kind)


def fixed_drafts(model: str) -> list[_Draft]:
    """Cases every corpus holds, whatever the seed: each limit, each class of encoding fault on
    each route, the references that must reproduce, the big bodies."""
    hello = [{"role": "user", "content": "Hello"}]
    chat = {"model": model, "messages": hello, "max_tokens": 1}
    completion = {"model": model, "prompt": "Hi", "max_tokens": 1}
    drafts: list[_Draft] = []

    def add(kind, body, expect, label, **kwargs):
        drafts.append(_Draft(kind, body, expect, label, **kwargs))

    def over(name):  # over a count or size limit
        return bad(name, statuses=(400, 413))

    def unparsable(name):  # nesting beyond what a JSON parser takes: any param or the field
        return bad(name, statuses=(400, 413), null_ok=True)

    for kind, base in (("chat", chat), ("completion", completion)):
        text_field = "messages" if kind == "chat" else "prompt"
        for stream in (False, True):
            b = {**base, "stream": stream}
            sfx = ", streamed" if stream else ""
            lp = {"logprobs": True} if kind == "chat" else {"logprobs": 1}
            add(kind, {**b, "seed": 2**64}, bad("seed"), f"seed 2**64{sfx}")
            add(kind, {**b, "seed": 2**64 - 1}, ok_or_bad("seed"), f"seed 2**64-1{sfx}")
            add(kind, {**b, "model": "x\udfff"}, bad("model"), f"lone surrogate in model{sfx}")
            add(
                kind,
                {**b, "model": Raw(b'"x\xed\xa0\x80"')},
                bad("model", null_ok=True),
                f"raw ED A0 80 in model{sfx}",
            )
            add(kind, {**b, "stop": ["x"] * 10_000}, over("stop"), f"10000 stop strings{sfx}")
            add(kind, {**b, "stop": "s" * 50_000}, over("stop"), f"a 50000-char stop{sfx}")
            bias = {str(i): 1 for i in range(20_000)}
            add(kind, {**b, "logit_bias": bias}, over("logit_bias"), f"20000 logit_bias{sfx}")
            add(kind, {**b, "metadata": nested(DEEP)}, over("metadata"), f"{DEEP} deep{sfx}")
            add(
                kind,
                {**b, "repetition_penalty": 1e-45, **lp},
                ok_or_bad("repetition_penalty"),
                f"repetition_penalty 1e-45, logprobs{sfx}",
            )
            add(
                kind,
                {**b, "repetition_penalty": 1e300, **lp},
                ok_or_bad("repetition_penalty"),
                f"repetition_penalty 1e300, logprobs{sfx}",
            )
            add(
                kind,
                {**b, "top_p": 1e-46, **lp},
                OK,
                f"top_p 1e-46, logprobs{sfx}",
            )
            add(kind, {**b, "temperature": 1e308}, ok_or_bad("temperature"), f"temp 1e308{sfx}")
        add(kind, {**base, "metadata": nested(TOO_DEEP)}, unparsable("metadata"), "5000 deep")
        add(kind, {**base, "metadata": nested(100_000)}, unparsable("metadata"), "100000 deep")
        add(
            kind,
            {**base, "metadata": nested(DEEP, "1", "object")},
            over("metadata"),
            f"{DEEP} deep objects",
        )
        add(kind, {**base, "n": Raw("9" * 5000)}, bad("n", null_ok=True), "a 5000-digit n")
        nan = bad("max_tokens", null_ok=True)
        add(kind, {**base, "max_tokens": Raw("NaN")}, nan, "NaN max_tokens")
        add(kind, {**base, "temperature": Raw("NaN")}, bad("temperature", null_ok=True), "NaN")
        add(kind, {**base, "top_p": Raw("Infinity")}, bad("top_p", null_ok=True), "Infinity")
        add(
            kind,
            {**base, "presence_penalty": Raw("-Infinity")},
            bad("presence_penalty", null_ok=True),
            "-Infinity presence_penalty",
        )
        add(kind, {**base, "frequency_penalty": Raw("1e400")}, bad("frequency_penalty"), "1e400")
        add(kind, {**base, "seed": 1e308}, bad("seed"), "seed 1e308")
        pad = Raw(b'"' + b"x" * HUGE_BODY_BYTES + b'"')
        add(kind, {**base, "padding": pad}, any_error(413), "a 16 MiB body")
        big = encode_body({**base, "padding": pad})
        add(kind, {}, any_error(413), "a 16 MiB body, chunked", raw=big, chunked=True)
        add(kind, {**base, "user": "\udfff"}, bad("user"), "lone surrogate in user")
        add(kind, {**base, "metadata": {"\udfff": 1}}, bad("metadata"), "lone surrogate in a key")
        add(kind, {**base, "\udfffkey": 1}, any_error(400), "lone surrogate in a top-level key")
        add(kind, {**base, "stop": "\udfff"}, bad("stop"), "lone surrogate in stop")
        add(kind, {**base, "logit_bias": {"\udfff": 1}}, bad("logit_bias"), "surrogate bias key")
        add(kind, {**base, "stop": "\ud83d\ude00"}, OK, "paired surrogates in stop")
        greedy = {**base, "max_tokens": 3, "temperature": 0}
        for name, value in (("top_p", 1e-46), ("top_p", 5e-324), ("top_p", 1e-300), ("top_k", 1)):
            body = {**base, "max_tokens": 3, "temperature": 1.0, name: value}
            add(kind, body, OK, f"{name} {value} keeps the top token", reference=greedy)
        add(
            kind,
            {**base, "max_tokens": 3, "temperature": 1e-308},
            ok_or_bad("temperature"),
            "temperature 1e-308 is greedy",
            reference=greedy,
        )
        add(
            kind,
            {**base, "metadata": nested(200)},
            ok_or_bad("metadata", statuses=(400, 413)),
            "200 deep",
        )
        for raw in INVALID_UTF8:
            b = dict(base)
            if kind == "chat":
                b["messages"] = [{"role": "user", "content": Raw(b'"a' + raw + b'"')}]
            else:
                b["prompt"] = Raw(b'"a' + raw + b'"')
            label = f"raw bytes {raw!r} in {text_field}"
            add(kind, b, bad(text_field, null_ok=True), label)
    add("chat", {**chat, "messages": hello * 20_000}, over("messages"), "20000 messages")
    add(
        "chat",
        {**chat, "messages": [{"role": "user", "content": nested(DEEP)}]},
        over("messages"),
        f"content {DEEP} deep",
    )
    add(
        "chat",
        {**chat, "messages": [{"role": "user", "content": nested(TOO_DEEP)}]},
        unparsable("messages"),
        "content 5000 deep",
    )
    add(
        "chat",
        {**chat, "chat_template_kwargs": {"x": nested(DEEP)}},
        over("chat_template_kwargs"),
        f"chat_template_kwargs {DEEP} deep",
    )
    schema = nested(DEEP, '{"type": "object"}', "object")
    add(
        "chat",
        {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        over("response_format"),
        f"json schema {DEEP} deep",
    )
    add(
        "chat",
        {**chat, "guided_json": nested(DEEP, "{}", "object")},
        over("guided_json"),
        f"guided_json {DEEP} deep",
    )
    add(
        "chat",
        {**chat, "messages": [{"role": "user", "content": "\ud800"}]},
        bad("messages"),
        "lone surrogate in content",
    )
    part = [{"type": "text", "text": "\udfff"}]
    add(
        "chat",
        {**chat, "messages": [{"role": "user", "content": part}]},
        bad("messages"),
        "lone surrogate in a content part",
    )
    tool = {**TOOL, "function": {**TOOL["function"], "name": "f\udfff"}}
    add(
        "chat",
        {**chat, "tools": [tool], "tool_choice": "required"},
        bad("tools"),
        "lone surrogate in a tool name",
    )
    template = "{{ messages[0]['content'] }}"
    add("chat", {**chat, "chat_template": template}, bad("chat_template"), "chat_template")
    loop = "{% for i in range(2000000) %}{% endfor %}" + template
    add("chat", {**chat, "chat_template": loop}, bad("chat_template"), "slow chat_template")
    add(
        "chat",
        {**chat, "chat_template_kwargs": {"chat_template": loop}},
        bad("chat_template_kwargs"),
        "slow chat_template in chat_template_kwargs",
    )
    add("chat", {**chat, "chat_template_kwargs": {"x": nested(20)}}, OK, "kwargs 20 deep")
    add(
        "chat",
        {
            **chat,
            "stream": True,
            "n": 3,
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "stream_options": {"include_usage": True},
        },
        OK,
        "n, stream, logprobs and usage",
    )
    add(
        "chat",
        {**chat, "tools": [TOOL], "tool_choice": "required", "max_tokens": 4, "stream": True},
        OK,
        "required tool call, streamed",
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    add(
        "chat",
        {**chat, "tools": [TOOL], "tool_choice": named, "max_tokens": 4},
        OK,
        "named tool call",
    )
    add("completion", {**completion, "prompt": ["a"] * 10_000}, over("prompt"), "10000 prompts")
    add("completion", {**completion, "prompt": [[17]] * 10_000}, over("prompt"), "10000 id lists")
    add(
        "completion",
        {**completion, "prompt": nested(DEEP, "1")},
        over("prompt"),
        f"prompt {DEEP} deep",
    )
    add("completion", {**completion, "prompt": "\udfff"}, bad("prompt"), "lone surrogate prompt")
    add(
        "completion",
        {**completion, "prompt": ["ok", "\udfff"]},
        bad("prompt"),
        "lone surrogate in a prompt list",
    )
    add(
        "completion",
        {**completion, "prompt": Raw(b'"\xed\xa0\x80"')},
        bad("prompt", null_ok=True),
        "raw ED A0 80 prompt",
    )
    add(
        "completion",
        {
            **completion,
            "echo": True,
            "logprobs": 3,
            "max_tokens": 2,
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
        OK,
        "echo, logprobs, n, stream and usage",
    )
    add(
        "completion",
        {**completion, "stop_token_ids": list(range(20_000))},
        ok_or_bad("stop_token_ids", statuses=(400, 413)),
        "20000 stop_token_ids",
    )
    return drafts


def _fixed_cases(model: str, start: int) -> list[Case]:
    return [_draft_case(start + i, d) for i, d in enumerate(fixed_drafts(model))]


def generate_cases(seed: int, count: int, model: str, fixed: bool = True) -> list[Case]:
    """``count`` cases (at least the fixed ones when ``fixed``), in a seeded shuffled order;
    ``Case.id`` is stable for a seed (:func:`select_cases`)."""
    rng = random.Random(seed)
    cases = _fixed_cases(model, 0) if fixed else []
    while len(cases) < count:
        cases.append(random_case(rng, len(cases), model))
    rng.shuffle(cases)
    return cases


def bound_cases(model: str, start: int = 100_000) -> list[Case]:
    """``n`` far above the bound (a 400 naming ``n``), in rising order: sent one at a time,
    last (a server without the bound may hang on them)."""
    cases = []
    values = [DEFAULT_MAX_N + 1, 100, 1000, 10**6, 10**12, 2**63 - 1, 2**64]
    for i, value in enumerate(values):
        for stream in (False, True):
            kind = "chat" if (i + stream) % 2 == 0 else "completion"
            body: dict = {"model": model, "max_tokens": 1, "n": value, "stream": stream}
            body.update(
                {"messages": [{"role": "user", "content": "Hi"}]}
                if kind == "chat"
                else {"prompt": "Hi"}
            )
            draft = _Draft(kind, body, bad("n"), f"n={value}{' stream' if stream else ''}")
            cases.append(_draft_case(start + len(cases), draft))
    return cases


def select_cases(cases: list[Case], spec: str | None) -> list[Case]:
    """The cases whose ids ``spec`` lists (``"3,17,42"``), all when ``spec`` is empty."""
    if not spec:
        return cases
    wanted = {int(x) for x in spec.replace(" ", "").split(",") if x}
    return [c for c in cases if c.id in wanted]
