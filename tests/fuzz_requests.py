"""Hostile clients for ``tests/entrypoints/openai/test_fuzz.py``,
``tests/entrypoints/openai/test_load.py`` and ``benchmarks/soak.py``.

- :func:`generate_cases`: a seeded corpus of HTTP requests over every route and field of the
  server (valid ones and faulty ones: wrong types, out-of-range and extreme numbers, invalid
  Unicode, empty and huge strings, deep nesting, wrong content types, invalid JSON, limits,
  combinations, streamed and not), each with what a correct server must answer
  (:class:`Expect`). Requests are cheap: ``max_tokens`` 1-4, ``n`` at most 3, short prompts
  (except the few ``n`` far above any bound, in :func:`bound_cases`).
- :func:`run_cases` sends them concurrently and :func:`check_case` judges each answer: no 5xx,
  no dropped connection, the status expected, every 4xx in OpenAI's error shape naming the
  expected ``param`` (a ``kind="messages"`` case's in Anthropic's shape, its message naming the
  field: :func:`check_anthropic_error_body`, :func:`message_names`), well-formed JSON and SSE
  without NaN or Infinity.
- :func:`stream_client` and the raw-socket slow and broken clients (:func:`trickled_body`,
  :func:`short_body_then_close`, :func:`idle_sockets`, :func:`unread_stream`) of the load test.

Which fault must name which ``param`` (:class:`Expect`, prefix match: ``messages`` matches
``messages[0].content``, ``response_format`` matches ``response_format.json_schema.schema``):

- a wrong type, an out-of-range value, an unsupported value, too many or too long items of
  one field (``stop``, ``messages``, ``logit_bias``, ``prompt`` lists), nesting too deep
  under one field, a lone surrogate written as a JSON escape (``"\\udfff"``) in one field:
  that top-level field (an unknown field's own name, e.g. ``metadata``);
- a top-level field the server does not know (:data:`UNKNOWN_FIELDS`): a 400 naming it, or the
  field of the case's other fault, whichever is checked first;
- two output constraints: either of them; a tool fault: ``tools`` or ``tool_choice``;
- what fails as the body is parsed, before any field is known: raw invalid UTF-8 bytes in a
  string, ``NaN``/``Infinity`` literals (not JSON), a 5000-digit integer, nesting beyond what
  Python's parser takes: a 400 (413) naming the field or no ``param``;
- invalid JSON, a body that is not an object, a wrong content type, unknown routes, wrong
  methods, a body over the size limit: any ``param``;
- values a server may serve or refuse (``seed`` in [2**63, 2**64), ``repetition_penalty``
  1e-45, huge schemas, "3" for an int...): a 200, or a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx

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

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def add(a, b):",
    "1, 2, 3,",
    "Once upon a time",
    "Bonjour 😀",
    "日本語のテキスト",
    "Ünïcödé “quotes” — dash",
    "a\u0000b",
    "   ",
    "\n\n",
    "e\u0301\u200b\u202e\ufeff\uffff\U0010ffff",
]
WORDS = ["Hello", "What is 2+2?", "Say yes.", "Name a color.", "Tell me a joke.", "¿Qué tal?"]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
VALID_CONSTRAINTS = [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "text"}),
    (
        "response_format",
        {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        },
    ),
    ("structured_outputs", {"choice": ["yes", "no"]}),
    ("structured_outputs", {"regex": "[a-z]{1,3}"}),
    ("structured_outputs", {"json": {"type": "integer"}}),
    ("structured_outputs", {"json": '{"type": "boolean"}'}),
    ("structured_outputs", {"grammar": 'root ::= "a" | "b"'}),
    ("structured_outputs", {"json_object": True}),
    ("guided_choice", ["red", "green"]),
    ("guided_regex", "[0-9]+"),
    ("guided_json", {"type": "string", "maxLength": 3}),
]
INVALID_CONSTRAINTS = [
    ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": "nope"}}),
    ("structured_outputs", {}),
    ("structured_outputs", {"regex": "("}),
    ("structured_outputs", {"regex": "[a-"}),
    ("structured_outputs", {"grammar": "this is not a grammar ::="}),
    ("structured_outputs", {"choice": []}),
    ("structured_outputs", {"choice": "yes"}),
    ("structured_outputs", {"json": "{not json"}),
    ("structured_outputs", {"json": {"type": "nonsense"}}),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"backend": "outlines", "regex": "a"}),
    ("guided_json", {"type": "nonsense"}),
    ("guided_json", 5),
    ("guided_regex", "["),
    ("guided_choice", []),
    ("guided_grammar", "::= ::="),
]
UNUSUAL_UNICODE = ["\ud83d\ude00 paired", "a\u0000b", "\uffff\U0010ffff", "e\u0301", "\u202e\u200b"]
# Schemas, regexes and grammars that are valid but huge or odd: a 200 or a 400 naming the field
# (never a 5xx or a hang).
EXTREME_CONSTRAINTS = [
    ("guided_json", {"type": "string", "minLength": 1000000}),
    ("guided_json", {"type": "string", "maxLength": 2**64}),
    ("guided_json", {"type": "array", "minItems": 10**9}),
    ("guided_json", {"type": "integer", "minimum": 1e308}),
    ("guided_json", {"type": "number", "multipleOf": 1e-300}),
    ("guided_json", {"type": "string", "pattern": "(a+)+$"}),
    ("guided_json", {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}),
    ("guided_json", {"enum": list(range(3000))}),
    ("guided_json", {"type": "object", "additionalProperties": {"type": "object"}}),
    ("guided_json", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
    ("guided_json", {"not": {}}),
    ("guided_json", False),
    ("guided_json", True),
    ("guided_json", {}),
    ("guided_regex", "a{100000}"),
    ("guided_regex", "(a|b){10000}"),
    ("guided_regex", "\\p{L}+"),
    ("guided_regex", "(?i)abc"),
    ("guided_regex", ""),
    ("guided_regex", "[^\\x00-\\x{10FFFF}]"),
    ("guided_regex", "\\b\\B"),
    ("guided_choice", [""]),
    ("guided_choice", ["a"] * 2000),
    ("guided_choice", ["x" * 20000]),
    ("guided_grammar", "start: /a{10000}/"),
    ("guided_grammar", 'root ::= "a" root'),
    ("guided_grammar", "root ::= root"),
]
# (field, value, expect) of values in a type pydantic's lax mode may convert.
_LAX_COMMON = [
    ("max_tokens", 2.0, OK),
    ("max_tokens", "3", ok_or_bad("max_tokens")),
    ("n", 1.0, OK),
    ("n", "2", ok_or_bad("n")),
    ("seed", 5.0, OK),
    ("seed", "7", ok_or_bad("seed")),
    ("temperature", "0.5", ok_or_bad("temperature")),
    ("temperature", True, ok_or_bad("temperature")),
    ("top_k", True, ok_or_bad("top_k")),
    ("stream", "true", ok_or_bad("stream")),
    ("stream", 0, ok_or_bad("stream")),
    ("ignore_eos", "false", ok_or_bad("ignore_eos")),
    ("stop", ("a", "b"), OK),
]
LAX_VALUES = {
    "chat": _LAX_COMMON + [("logprobs", "true", ok_or_bad("logprobs"))],
    "completion": _LAX_COMMON + [("echo", 1, ok_or_bad("echo")), ("logprobs", 1.0, OK)],
}
# chat_template_kwargs that clash with apply_chat_template's own arguments: a 200 or a 400
# naming chat_template_kwargs (the fault is there, not in messages).
TEMPLATE_KWARGS = [
    {"messages": "x"},
    {"conversation": []},
    {"tokenize": False},
    {"return_dict": True},
    {"return_tensors": "pt"},
    {"tools": "x"},
    {"documents": "x"},
    {"continue_final_message": True},
    {"return_assistant_tokens_mask": True},
    {"truncation": True, "max_length": 1},
    {"padding": "max_length", "max_length": 600},
    {"self": 1},
    {"add_generation_prompt": "x"},
]
SURROGATES = ["\udfff", "\ud800", "x\udc00y", "\ud800\ud800", "abc\ud83d", "\udbff!"]
INVALID_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\xc0\xaf",
    b"\x80",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\xf8\x88\x80\x80\x80",
]
WRONG = {
    "int": ["many", [], {}, 1.5, "1.5", "", [1]],
    "float": ["hot", [], {}, "", "1,5", [0.5]],
    "bool": ["sometimes", 2, [], {}, 0.5, "2"],
    "str": [5, [], {}, True, 1.5],
}
COMMON_TYPES = {
    "n": "int",
    "max_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "seed": "int",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
    "min_tokens": "int",
    "stream": "bool",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool",
    "user": "str",
    "model": "str",
    "best_of": "int",
    "use_beam_search": "bool",
    "length_penalty": "float",
    "prompt_logprobs": "int",
    "guided_regex": "str",
    "guided_grammar": "str",
    "guided_decoding_backend": "str",
}
CHAT_TYPES = {
    **COMMON_TYPES,
    "max_completion_tokens": "int",
    "logprobs": "bool",
    "top_logprobs": "int",
    "parallel_tool_calls": "bool",
    "add_generation_prompt": "bool",
}
COMPLETION_TYPES = {**COMMON_TYPES, "echo": "bool", "logprobs": "int", "suffix": "str"}
# Other fields' wrong values (each a 400 naming the field).
WRONG_SHAPES = {
    "stop": [7, {"a": 1}, [1], [[]], [None]],
    "stop_token_ids": ["x", [1.5], ["a"], {}, 3],
    "logit_bias": [[1], "x", 5, {"1": "x"}, {"1": None}, {"1": [1]}],
    "stream_options": ["x", 5, [], {"include_usage": "maybe"}],
    "response_format": ["json", 5, [], {}, {"type": 5}],
    "structured_outputs": ["x", [], 5],
    "guided_choice": ["x", [1], {}],
    "chat_template_kwargs": ["x", [], 5],
}
# Fields a beam search (use_beam_search) is refused with (beside the constraint fields), and
# the beam width, n.
BEAM_SEARCH_CONFLICTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "tools",
    "thinking_token_budget",
    "logprobs",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "grammar",
    "n",
)
# (field, value, expect) of numbers out of range or extreme, for chat and completions.
INF, NAN = float("inf"), float("nan")


def _number_faults() -> list[tuple[str, object, Expect]]:
    faults: list[tuple[str, object, Expect]] = []

    def add(name, values, expect):
        faults.extend((name, v, expect) for v in values)

    add("n", [0, -1, Raw("-0"), 1e308, -(2**64), Raw("9" * 5000)], bad("n", null_ok=True))
    add("max_tokens", [0, -1, Raw("-0"), 2**64, 10**12, 2**31, 1e308], bad("max_tokens"))
    add("temperature", [-1, -1e-300, INF, -INF, NAN, Raw("1e400")], bad("temperature"))
    add(
        "temperature",
        [1e308, 1e-308, 5e-324, Raw("-0.0"), 1e6 + 1, 100.0],
        ok_or_bad("temperature"),
    )
    add("top_p", [0, Raw("-0.0"), 1.0000001, 1.5, 1e308, NAN, -INF, -1e-308], bad("top_p"))
    add("top_k", [-2, -(2**63), -(10**30)], bad("top_k"))
    add("top_k", [2**64, 2**31, 10**30, VOCAB_SIZE + 1], ok_or_bad("top_k"))
    add("min_p", [-0.1, 1.1, 1e308, NAN, INF], bad("min_p"))
    add("min_p", [1.0, 5e-324, Raw("-0.0")], OK)
    for name in ("presence_penalty", "frequency_penalty"):
        add(name, [2.0001, -2.5, 1e308, -1e308, NAN, INF], bad(name))
        add(name, [-2, 2, Raw("-0.0"), 5e-324], OK)
    add("repetition_penalty", [0, -1, Raw("-0.0"), NAN, INF], bad("repetition_penalty"))
    add(
        "repetition_penalty",
        [1e-45, 5e-324, 1e-320, 1e300, 1e308, 1e-7],
        ok_or_bad("repetition_penalty"),
    )
    add("seed", [2**64, 2**64 + 1, 10**30, 2**128, 1e308], bad("seed"))
    add("seed", [2**63, 2**64 - 1, -1, -(2**63), -(2**63) - 1, -(10**30)], ok_or_bad("seed"))
    add("min_tokens", [-1, 2**64, 50], bad("min_tokens"))
    add("best_of", [5, 0, 2**64], bad("best_of"))
    add("prompt_logprobs", [0, 1, 2**64], bad("prompt_logprobs"))
    add("use_beam_search", [True], ok_or_bad("use_beam_search", *BEAM_SEARCH_CONFLICTS))
    add("length_penalty", [2.0, -1.0, NAN, INF], bad("length_penalty"))  # without beam search
    add("guided_decoding_backend", ["xgrammar", "outlines"], bad("guided_decoding_backend"))
    add("guided_whitespace_pattern", [" *"], bad("guided_whitespace_pattern"))
    add(
        "logit_bias",
        [
            {"1": 101},
            {"1": -100.5},
            {"1": 1e308},
            {"1": NAN},
            {"1": INF},
            {"abc": 1},
            {"1.5": 1},
            {"": 1},
        ],
        bad("logit_bias"),
    )
    add(
        "logit_bias",
        [{"-1": 1}, {str(OUT_OF_VOCAB): 1}, {str(2**64): 1}, {" 12": 1}],
        ok_or_bad("logit_bias"),
    )
    add("stop_token_ids", [[-1], [2**64], [OUT_OF_VOCAB]], ok_or_bad("stop_token_ids"))
    return faults


NUMBER_FAULTS = _number_faults()
CHAT_NUMBER_FAULTS = [
    ("max_completion_tokens", v, bad("max_completion_tokens")) for v in (0, -1, 2**64)
] + [("top_logprobs", v, bad("top_logprobs")) for v in (-1, 21, 2**64)]
COMPLETION_NUMBER_FAULTS = [("logprobs", v, bad("logprobs")) for v in (-1, 21, 2**64)] + [
    ("suffix", "x", bad("suffix"))
]


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

GET_ROUTES = ["/health", "/debug/stats", "/metrics", "/version", "/v1/models"]
POST_ROUTES = [CHAT_PATH, COMPLETIONS_PATH, "/tokenize", "/detokenize"]
UNKNOWN_ROUTES = [
    "/v1/nothing-here",
    "/v2/chat/completions",
    "/v1/chat/completions/extra",
    "/v1/chat",
    "/admin",
    "/%FF%FE",
    "/v1/models-x",
    "/v1/completions.json",
    "/" + "a" * 2000,
    "/debug/stats/more",
    "/healthz",
]


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
            from tests.fuzz_responses import check_responses_200  # it builds on this module

            problems += check_responses_200(case, headers, body)
        elif case.kind == "messages":
            from tests.fuzz_messages import check_messages_200  # it builds on this module

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


# --- sending ------------------------------------------------------------------------------------


@dataclass
class Result:
    """What the server answered a case, and what is wrong with it."""

    case: Case
    status: int | None
    problems: list[str]
    seconds: float
    excerpt: bytes = b""


async def _chunks(body: bytes, size: int = 1 << 20):
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def send_case(
    client: httpx.AsyncClient, case: Case, timeout: float = 60.0
) -> tuple[int | None, httpx.Headers | None, bytes, str | None]:
    """``(status, headers, body, transport error)`` of one case."""
    content = _chunks(case.body) if case.chunked and case.body else case.body
    try:
        request = client.build_request(
            case.method, case.path, content=content, headers=case.headers, timeout=timeout
        )
        response = await client.send(request, stream=True)
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        return response.status_code, response.headers, body, None
    except httpx.HTTPError as exc:
        return None, None, b"", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a case the client cannot send: the corpus's bug
        return None, None, b"", f"the client could not send it: {type(exc).__name__}: {exc}"


async def run_cases(
    base_url: str,
    cases: list[Case],
    concurrency: int = 12,
    timeout: float = 60.0,
    references: dict[bytes, str] | None = None,
    deadline: float | None = None,
    on_result: Callable[[Result], None] | None = None,
    skip_reason: str = "the time budget ran out",
) -> list[Result]:
    """Send ``cases`` ``concurrency`` at a time over keep-alive connections and judge each
    answer; cases not started by ``deadline`` (``time.monotonic()``) are skipped."""
    results: list[Result] = []
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            case = queue.get_nowait()
            if deadline is not None and time.monotonic() > deadline:
                results.append(Result(case, None, [f"not sent: {skip_reason}"], 0.0))
                continue
            start = time.monotonic()
            status, headers, body, error = await send_case(client, case, timeout)
            problems = check_case(case, status, headers, body, error, references)
            result = Result(case, status, problems, time.monotonic() - start, body[:300])
            results.append(result)
            if on_result is not None:
                on_result(result)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


async def compute_references(base_url: str, cases: list[Case]) -> dict[bytes, str]:
    """The greedy text of each distinct reference body of ``cases``, one request at a time."""
    references: dict[bytes, str] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for case in cases:
            if case.reference is None or case.reference in references:
                continue
            response = await client.post(case.path, content=case.reference, headers=JSON_HEADERS)
            response.raise_for_status()
            references[case.reference] = choice_text(case.kind, response.json()["choices"][0])
    return references


def summarize(results: list[Result], seed: int, base_url: str, limit: int = 40) -> str:
    """The failures of ``results``, one paragraph each (its case, its repro and the problems),
    grouped by label and first problem, most frequent first."""
    failed = [r for r in results if r.problems]
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in failed:
        first = result.problems[0]
        key = (result.case.label.split(":")[0], first[:60])
        groups.setdefault(key, []).append(result)
    lines = [
        f"{len(failed)} of {len(results)} requests failed (seed {seed}; rerun with "
        f"PYXLLM_FUZZ_SEED={seed}, only some with PYXLLM_FUZZ_CASES=<ids>), "
        f"{len(groups)} kinds:"
    ]
    for (_, _), members in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]:
        result = members[0]
        ids = ",".join(str(r.case.id) for r in members[:20])
        lines.append(f"\n* {len(members)}x, ids {ids}: {result.case.describe(400)}")
        lines.append(f"  expected {result.case.expect.describe()}; got {result.status}")
        for problem in result.problems[:3]:
            lines.append(f"  - {problem[:700]}")
        lines.append(f"  repro: {result.case.repro(base_url)[:1500]}")
    return "\n".join(lines)


# --- load: many streaming clients ----------------------------------------------------------------


@dataclass
class StreamOutcome:
    """One streaming client: its request, the text it read, whether it hung up early."""

    kind: str
    body: dict
    text: str = ""
    chunks: int = 0
    hung_up: bool = False
    problems: list[str] = field(default_factory=list)
    status: int | None = None


async def stream_client(
    client: httpx.AsyncClient, kind: str, body: dict, hang_up_after: int | None
) -> StreamOutcome:
    """Stream ``body`` to its end, or hang up after ``hang_up_after`` content chunks."""
    outcome = StreamOutcome(kind, body)
    path = CHAT_PATH if kind == "chat" else COMPLETIONS_PATH
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.problems.append(
                    f"status {response.status_code}: {await response.aread()!r:.300}"
                )
                return outcome
            raw = b""
            async for line in response.aiter_lines():
                raw += line.encode() + b"\n"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = strict_json(line[len("data: ") :])
                if "error" in chunk:
                    outcome.problems.append(f"error event {line[:300]}")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content") if kind == "chat" else None
                    outcome.text += (delta if kind == "chat" else choice.get("text")) or ""
                outcome.chunks += 1
                if hang_up_after is not None and outcome.chunks >= hang_up_after:
                    outcome.hung_up = True
                    return outcome  # leaving the block closes the connection
            if not raw.rstrip().endswith(b"data: [DONE]"):
                outcome.problems.append(f"stream did not end with [DONE]: {raw[-200:]!r}")
    except (httpx.HTTPError, ValueError) as exc:
        outcome.problems.append(f"{type(exc).__name__}: {exc}")
    return outcome


# --- slow and broken clients (raw sockets) -------------------------------------------------------


def _request_head(path: str, length: int | None, host: str, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode()


async def _read_status(reader: asyncio.StreamReader, timeout: float) -> int | None:
    """The status of the response on ``reader``, ``None`` if the server closed without one."""
    line = await asyncio.wait_for(reader.readline(), timeout)
    if not line:
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def trickled_body(
    host: str, port: int, body: bytes, step: int = 3, interval: float = 0.2
) -> tuple[int | None, bytes]:
    """Send a request whose body comes ``step`` bytes every ``interval`` seconds; return the
    status and the response's first bytes."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request_head(COMPLETIONS_PATH, len(body), f"{host}:{port}"))
        await writer.drain()
        for start in range(0, len(body), step):
            writer.write(body[start : start + step])
            await writer.drain()
            await asyncio.sleep(interval)
        status = await _read_status(reader, 60)
        rest = await asyncio.wait_for(reader.read(2000), 60)
        return status, rest
    finally:
        writer.close()


async def short_body_then_close(host: str, port: int, declared: int, sent: bytes) -> None:
    """Declare ``declared`` body bytes, send ``sent`` (fewer), then close the socket."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_request_head(COMPLETIONS_PATH, declared, f"{host}:{port}") + sent)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()


async def short_body_then_half_close(
    host: str, port: int, declared: int, sent: bytes, timeout: float = 10.0
) -> int | None:
    """Declare ``declared`` body bytes, send ``sent``, shut the write side and wait for an
    answer: its status, ``None`` when the server just closes, -1 when it does neither within
    ``timeout`` seconds."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request_head(COMPLETIONS_PATH, declared, f"{host}:{port}") + sent)
        await writer.drain()
        writer.write_eof()
        try:
            return await _read_status(reader, timeout)
        except (ConnectionError, asyncio.IncompleteReadError):
            return None
        except asyncio.TimeoutError:
            return -1  # neither an answer nor a close
    finally:
        writer.close()


def idle_sockets(host: str, port: int, count: int, partial: bool) -> list[socket.socket]:
    """``count`` open connections that send nothing (or, with ``partial``, half a request
    head)."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        if partial:
            sock.sendall(f"POST {COMPLETIONS_PATH} HTTP/1.1\r\nHost: {host}\r\n".encode())
        sockets.append(sock)
    return sockets


def unread_stream(host: str, port: int, body: dict) -> socket.socket:
    """Open a streaming request and never read it (a small receive buffer, so that the server's
    writes soon block); the caller closes the socket."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(_request_head(COMPLETIONS_PATH, len(data), f"{host}:{port}") + data)
    return sock


def server_rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def wait_idle(base_url: str, timeout: float = 15.0) -> dict:
    """Poll ``/debug/stats`` until nothing runs or waits and no KV block is used (aborts settle
    asynchronously); return the last stats (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = httpx.get(base_url + "/debug/stats", timeout=5).json()
        except httpx.HTTPError as exc:
            stats = {"error": repr(exc)}
        if is_idle(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def is_idle(stats: dict) -> bool:
    """Nothing running or waiting, no KV block used."""
    return (
        stats.get("num_running") == 0
        and stats.get("num_waiting") == 0
        and stats.get("num_kv_blocks_used") == 0
    )


def server_tracebacks(log: str, limit: int = 8) -> list[str]:
    """The distinct tracebacks (by their last pyxllm frame and exception type) in a server's
    output, the last ``limit``, each cut to pyxllm's own frames and the exception."""
    blocks: dict[str, str] = {}
    lines = log.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last)"):
            i += 1
            continue
        j = i + 1
        frames = []
        while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
            if "/pyxllm/" in lines[j] and lines[j].lstrip().startswith("File "):
                code = lines[j + 1].strip() if j + 1 < len(lines) else ""
                frames.append(f"{lines[j].strip()}: {code}")
            j += 1
        exception = lines[j] if j < len(lines) else "?"
        key = f"{frames[-1] if frames else ''} {exception.split(':')[0]}"
        blocks.pop(key, None)
        blocks[key] = "\n".join([*frames[-6:], exception[:500]])
        i = j + 1
    return list(blocks.values())[-limit:]
