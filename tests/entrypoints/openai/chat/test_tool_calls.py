"""Tool calling: the parsers on recorded model texts (fed whole, token by token and character
by character, with the same calls and content each way), then the real ``openai`` SDK against
``pyxllm serve`` on the default model: ``required``, a named function, parallel calls, streamed
and not, a two-turn exchange, and the 400s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from pyxllm.engine.structured_output.json_schema import closed_objects
from pyxllm.entrypoints.openai.chat.tool_parsers import (
    ToolCallStream,
    get_tool_parser,
    split_tool_calls,
    tool_parser_names,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.constrained import (
    NamedCallParser,
    RequiredCallsParser,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.gpt_oss import OpenAIToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.granite import GraniteToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.hermes import HermesToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.mistral import MistralToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.phi4_mini import Phi4MiniToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.pythonic import PythonicToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.qwen3_coder import (
    Qwen3CoderToolParser,
    typed_value,
)
from pyxllm.entrypoints.openai.chat.tools import plan_tools
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolParam
from tests.utils import RemoteServer, run_together, tool_calling_server_args

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "description": "Check the service"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris and in London?"}]

# --- the parsers, on recorded texts ----------------------------------------------------------

# A tool whose parameters have every JSON type, for qwen3_coder's typed values.
TYPED = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer"},
                "volume": {"type": "number"},
                "repeat": {"type": "boolean"},
                "label": {"type": "string"},
                "days": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object"},
                "snooze": {"type": ["integer", "null"]},
            },
        },
    },
}
HERMES = HermesToolParser()
PYTHONIC = PythonicToolParser()
MISTRAL = MistralToolParser()
DEEPSEEK = DeepSeekV3ToolParser()
QWEN3_CODER = Qwen3CoderToolParser().for_tools(
    [ChatCompletionToolParam(**tool) for tool in [*TOOLS, TYPED]]
)
RECORDED = [
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments":'
        ' {"city": "London", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "ping",'
        ' "arguments": {}}\n</tool_call>',
        (
            "Let me check.",
            [
                ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ("get_weather", '{"city": "London", "unit": "celsius"}'),
                ("ping", "{}"),
            ],
        ),
    ),
    (
        HERMES,
        '<tool_call>{"name": "say", "arguments": {"text": "a \\"quoted\\" {brace} ]"}}</tool_call>',
        (None, [("say", '{"text": "a \\"quoted\\" {brace} ]"}')]),
    ),
    (
        HERMES,
        '<tool_call>\n{"name": "say", "arguments": {"text": "Zürich, 東京 🙂"}}\n</tool_call>',
        (None, [("say", '{"text": "Zürich, 東京 🙂"}')]),
    ),
    (
        HERMES,
        "The answer is 42 and no tool is needed <tool is a word>.",
        ("The answer is 42 and no tool is needed <tool is a word>.", []),
    ),
    (
        HERMES,
        '<tool_call>\n{"name": "say", "arguments": {"text": }\n</tool_call>',
        (None, [("say", '{"text": }')]),
    ),  # malformed: the raw text, as OpenAI's arguments may be
    (
        HERMES,
        "<tool_call>\nnot json at all\n</tool_call>",
        ("<tool_call>\nnot json at all\n</tool_call>", []),
    ),
    (
        Llama3JsonToolParser(),
        '{"name": "get_time", "parameters": {"city": "Oslo"}}; {"name": "ping", "parameters": {}}',
        (None, [("get_time", '{"city": "Oslo"}'), ("ping", "{}")]),
    ),
    (Llama3JsonToolParser(), "Oslo is in Norway.", ("Oslo is in Norway.", [])),
    (
        RequiredCallsParser(),
        '[{"name": "ping", "arguments": {}}, {"name": "get_time", "arguments": {"city": "Rome"}}]',
        (None, [("ping", "{}"), ("get_time", '{"city": "Rome"}')]),
    ),
    (
        NamedCallParser("get_time"),
        '{\n  "city": "Lima"\n}',
        (None, [("get_time", '{\n  "city": "Lima"\n}')]),
    ),
    # cut short by max_tokens: the arguments as far as the model wrote them, never "{}"
    (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        (None, [("get_weather", '{"city": "Pa')]),
    ),
    (HERMES, '<tool_call>\n{"name": "get_weather", ', (None, [("get_weather", "")])),
    (NamedCallParser("get_time"), '{"ci', (None, [("get_time", '{"ci')])),
    (Llama3JsonToolParser(), '{"name": "ping"}', (None, [("ping", "{}")])),  # whole, no arguments
    # a forced call cut before its name: no call to report, and its JSON is not content
    (RequiredCallsParser(), '[\n{\n    "name": "', (None, [])),
    (RequiredCallsParser(), "[\n{", (None, [])),
    # pythonic (Llama 3.2, Llama 4): Python literals come back as JSON
    (
        PYTHONIC,
        '[get_weather(city="Paris", unit="celsius"), get_time(city=\'Lon, (don)\'), ping()]',
        (
            None,
            [
                ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ("get_time", '{"city": "Lon, (don)"}'),
                ("ping", "{}"),
            ],
        ),
    ),
    (
        PYTHONIC,
        '<|python_start|>[get_weather(city="Zürich", unit="celsius")]<|python_end|>',
        (None, [("get_weather", '{"city": "Zürich", "unit": "celsius"}')]),
    ),
    (
        PYTHONIC,
        '[say(text="""a "b" \\n""", n=-1.5e3, ok=True, none=None, xs=[1, (2, 3)], d={"k": "v"}, )]',
        (
            None,
            [
                (
                    "say",
                    '{"text": "a \\"b\\" \\n", "n": -1500.0, "ok": true, "none": null, '
                    '"xs": [1, [2, 3]], "d": {"k": "v"}}',
                )
            ],
        ),
    ),
    (PYTHONIC, "Paris is in France.", ("Paris is in France.", [])),
    (PYTHONIC, "[1, 2] are numbers, not calls", ("[1, 2] are numbers, not calls", [])),
    # malformed: a non-literal (never evaluated) or positional argument stops the arguments
    (
        PYTHONIC,
        '[get_weather(city="Oslo", unit=__import__("os").getcwd())]',
        (None, [("get_weather", '{"city": "Oslo"')]),
    ),
    (PYTHONIC, '[get_time("Oslo")]', (None, [("get_time", "{")])),
    (PYTHONIC, '[get_weather(city="Pa', (None, [("get_weather", "{")])),  # cut short
    # mistral: the JSON array (v0.3) and name[ARGS]{...} (Mistral Small 3.2, Magistral)
    (
        MISTRAL,
        'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "ping", "arguments": {}}]',
        ("Checking.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("ping", "{}")]),
    ),
    (
        MISTRAL,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time'
        '[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}',
        (
            None,
            [
                ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ("get_time", '{"city": "Oslo"}'),
            ],
        ),
    ),
    (MISTRAL, "No call [here], [TOOL] is a word.", ("No call [here], [TOOL] is a word.", [])),
    (MISTRAL, "[TOOL_CALLS]not a call", ("[TOOL_CALLS]not a call", [])),
    (
        MISTRAL,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        (None, [("get_weather", '{"city": "Pa')]),
    ),
    # qwen3_coder: XML parameters typed by the tool's schema
    (
        QWEN3_CODER,
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        ("Let me look.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("ping", "{}")]),
    ),
    (
        QWEN3_CODER,
        "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n"
        "<parameter=volume>\n0.5\n</parameter>\n<parameter=repeat>\nTrue\n</parameter>\n"
        '<parameter=label>\n007\n</parameter>\n<parameter=days>\n["Mon", "Tue"]\n'
        "</parameter>\n<parameter=options>\n{'vibrate': True}\n</parameter>\n"
        "<parameter=snooze>\nnull\n</parameter>\n<parameter=extra>\n1\n</parameter>\n"
        "</function>\n</tool_call>",
        (
            None,
            [
                (
                    "set_alarm",
                    '{"hour": 7, "volume": 0.5, "repeat": true, "label": "007", "days": ["Mon", '
                    '"Tue"], "options": {"vibrate": true}, "snooze": null, "extra": "1"}',
                )
            ],
        ),
    ),
    # malformed: a value that is not its type stays text, a missing </parameter> is tolerated
    (
        QWEN3_CODER,
        "<tool_call>\n<function=set_alarm>\n<parameter=hour>\nseven\n<parameter=label>\n"
        "a <b>bold</b>\nlabel\n</function>\n</tool_call>",
        (None, [("set_alarm", '{"hour": "seven", "label": "a <b>bold</b>\\nlabel"}')]),
    ),
    (
        QWEN3_CODER,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        (None, [("get_weather", "{")]),
    ),  # cut short
    (QWEN3_CODER, "x <tool_call> oops", ("x <tool_call> oops", [])),
    # deepseek_v3: V3/R1's fenced JSON and V3.1's bare JSON
    (
        DEEPSEEK,
        "I will check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>ping\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        (
            "I will check.",
            [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("ping", "{}")],
        ),
    ),
    (
        DEEPSEEK,
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Oslo"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        (None, [("get_time", '{"city": "Oslo"}')]),
    ),
    (DEEPSEEK, "No tool▁call here <｜think｜>.", ("No tool▁call here <｜think｜>.", [])),
    (
        DEEPSEEK,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Pa',
        (None, [("get_weather", '{"city": "Pa')]),
    ),  # cut short
    # granite: a JSON array after <|tool_call|> (or <tool_call>)
    (
        GraniteToolParser(),
        '<|tool_call|>[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "ping", '
        '"arguments": {}}]',
        (None, [("get_time", '{"city": "Oslo"}'), ("ping", "{}")]),
    ),
    (
        GraniteToolParser(),
        ' <tool_call> [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ),
    (GraniteToolParser(), "<tool is a word>, [1] too.", ("<tool is a word>, [1] too.", [])),
    (
        GraniteToolParser(),
        '<|tool_call|>[{"name": "get_time", "arguments": {"city": "Os',
        (None, [("get_time", '{"city": "Os')]),
    ),
    # phi4_mini_json: functools[...]
    (
        Phi4MiniToolParser(),
        'functools[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "ping", '
        '"arguments": {}}]',
        (None, [("get_time", '{"city": "Oslo"}'), ("ping", "{}")]),
    ),
    (
        Phi4MiniToolParser(),
        "Python's functools module has lru_cache.",
        ("Python's functools module has lru_cache.", []),
    ),
    (
        Phi4MiniToolParser(),
        'Sure. functools[{"name": "get_time", "arguments": {"ci',
        ("Sure.", [("get_time", '{"ci')]),
    ),
    # openai: gpt-oss's harmony messages, calls on the commentary channel to=functions.NAME
    (
        OpenAIToolParser(),
        "<|channel|>analysis<|message|>Two cities.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary to=functions."
        'get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
        "<|start|>assistant to=functions.ping<|channel|>commentary json<|message|>{}<|call|>",
        (
            "Checking both.",
            [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("ping", "{}")],
        ),
    ),
    (
        OpenAIToolParser(),
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Paris is in France, <|b|> too.<|return|>",
        ("Paris is in France, <|b|> too.", []),
    ),
    (
        OpenAIToolParser(),
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"city": "Os',
        (None, [("get_time", '{"city": "Os')]),
    ),  # cut short
    (
        OpenAIToolParser(),
        '<|channel|>commentary to=functions.say<|message|>{"text": }<|call|>',
        (None, [("say", '{"text": }')]),
    ),  # malformed: the raw text
]


def streamed(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and calls a client assembles from the stream of ``pieces`` (cumulative)."""
    stream, content, calls = ToolCallStream(parser), "", {}
    for k, text in enumerate(pieces):
        delta, tool_calls = stream.update(text, k == len(pieces) - 1)
        indices = [d.index for d in tool_calls]
        assert len(set(indices)) == len(indices), "one entry per call in a chunk"
        content += delta
        for d in tool_calls:
            entry = calls.setdefault(d.index, ["", ""])
            if d.function.name:
                assert not entry[0] and d.id, "the name and id come once, first"
                entry[0] = d.function.name
            entry[1] += d.function.arguments or ""
    return content or None, [tuple(v) for _, v in sorted(calls.items())]


def token_pieces(tokenizer, text: str) -> list[str]:
    """The cumulative texts a stream shows token by token (a split UTF-8 character held)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: k + 1]).rstrip("\ufffd") for k in range(len(ids))]
    assert pieces[-1] == text
    return pieces


@pytest.mark.parametrize("parser, text, expected", RECORDED)
def test_parsers_give_the_same_calls_however_the_text_arrives(
    hf_gguf_tokenizer, parser, text, expected
):
    content, calls = split_tool_calls(parser, text)
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == expected
    assert streamed(parser, [text]) == expected
    assert streamed(parser, [text[: k + 1] for k in range(len(text))]) == expected
    assert streamed(parser, token_pieces(hf_gguf_tokenizer, text)) == expected


def test_every_registered_parser_has_recorded_texts():
    """Each parser --tool-call-parser offers is fed recorded texts character by character
    (above), so a parser added to the registry needs texts of its own here."""
    recorded = {type(parser) for parser, _, _ in RECORDED}
    assert {get_tool_parser(name) for name in tool_parser_names()} <= recorded


def test_qwen3_coder_values_take_their_schema_types():
    assert typed_value("\n42 ", {"type": "integer"}) == 42
    assert typed_value("4.5", {"type": "integer"}) == "4.5"
    assert typed_value("4", {"type": "number"}) == 4
    assert typed_value("false", {"type": ["boolean", "null"]}) is False
    assert typed_value("None", {"type": ["integer", "null"]}) is None
    assert typed_value("[1, 2]", {"items": {"type": "integer"}}) == [1, 2]
    assert typed_value("{1, 2}", {"type": "object"}) == "{1, 2}"  # a set is no object
    assert typed_value("42", {"type": "string"}) == "42"
    assert typed_value("42", None) == "42"  # not among the tool's parameters


def test_auto_gives_the_parser_the_requests_tools():
    """qwen3_coder types values by the tools of each request (plan_tools, not start-up)."""
    request = ChatCompletionRequest(messages=ASK, tools=[TYPED])
    parser = plan_tools(request, auto_parser=Qwen3CoderToolParser()).parser
    text = "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n</function>"
    assert parser.parse(text, final=True).calls[0].arguments == '{"hour": 7}'
    assert Qwen3CoderToolParser().parse(text, final=True).calls[0].arguments == '{"hour": "7"}'


def test_a_parser_whose_tags_are_special_tokens_keeps_them_in_the_text(hf_gguf_tokenizer):
    """An auto request keeps special tokens when the parser's tags are special for the
    tokenizer (Mistral's [TOOL_CALLS] ...); SmolLM2's <|im_end|> is special, [TOOL_CALLS] is
    plain text to it."""

    class ImEndParser(MistralToolParser):
        tags = ("<|im_end|>",)

    assert ImEndParser(hf_gguf_tokenizer).needs_special_tokens
    assert not MistralToolParser(hf_gguf_tokenizer).needs_special_tokens
    assert not MistralToolParser().needs_special_tokens


def test_tool_choice_rules_without_a_server():
    def plan(**body):
        return plan_tools(ChatCompletionRequest(messages=ASK, **body), auto_parser=None)

    assert plan().mode == "none" and plan(tools=TOOLS, tool_choice="none").mode == "none"
    required = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.limit == 1 and required.constraint.json["maxItems"] == 1
    for body, message in [
        ({"tool_choice": "required"}, "tool_choice: requires tools"),
        ({"tools": TOOLS}, '"auto" (the default with tools) cannot be served'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "no tool is named 'nope'",
        ),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "same function name"),
    ]:
        with pytest.raises(OpenAIError, match=re.escape(message)):
            plan(**body)


def test_a_schemas_objects_take_only_the_properties_they_list():
    """JSON Schema lets an object hold unlisted properties; the grammar of a forced call or a
    response_format does not (SmolLM2 wrote invented ones until max_tokens), unless the
    schema asks for them."""
    city = {"type": "string"}
    listed = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    closed = {**listed, "additionalProperties": False}
    assert closed_objects(listed) == closed
    assert "additionalProperties" not in listed  # a copy: the request's schema is untouched
    open_ = [
        {"type": "object"},  # a free-form dict
        {**listed, "additionalProperties": True},
        {**listed, "additionalProperties": {"type": "integer"}},
        {**listed, "patternProperties": {"^x": city}},
        {**listed, "unevaluatedProperties": False},
    ]
    for schema in open_:
        assert closed_objects(schema) == schema
    nested = {
        "type": "object",
        "properties": {
            "where": listed,
            "stops": {"type": "array", "items": listed},
            "either": {"anyOf": [listed, {"type": "null"}]},
            "both": {"allOf": [listed, {"properties": {"zip": city}}]},
            "ref": {"$ref": "#/$defs/place"},
            "fixed": {"const": listed},
        },
        "$defs": {"place": listed},
    }
    out = closed_objects(nested)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["where"] == props["stops"]["items"] == props["either"]["anyOf"][0] == closed
    assert out["$defs"]["place"] == closed
    # allOf's branches combine: their own level stays open, objects inside them close
    assert props["both"]["allOf"] == [listed, {"properties": {"zip": city}}]
    assert closed_objects({"allOf": [{"properties": {"a": listed}}]}) == {
        "allOf": [{"properties": {"a": closed}}]
    }
    assert props["fixed"] == {"const": listed}  # a value, not a schema


# --- over HTTP, on the default model ---------------------------------------------------------

MODEL = "smollm2-tools"


@pytest.fixture(scope="module")
def server():
    with RemoteServer(tool_calling_server_args(MODEL)) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def ask(client, stream: bool = False, **kwargs):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 160}
    return client.chat.completions.create(**{**body, **kwargs}, stream=stream)


def assemble(chunks) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] = d.function.name or entry[0]
            entry[1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(v) for _, v in sorted(calls.items())], finish


def ask_both(client, **kwargs) -> tuple:
    """The same request unstreamed and streamed (its chunks), at the same time."""
    return tuple(
        run_together(
            lambda: ask(client, **kwargs), lambda: list(ask(client, stream=True, **kwargs))
        )
    )


@pytest.fixture(scope="module")
def required_calls(client):
    """``tool_choice: "required"`` on :data:`ASK`, unstreamed and streamed."""
    return ask_both(client, tool_choice="required")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_calls_validate_streamed_or_not(client, required_calls, tool_choice):
    if tool_choice == "required":
        full, chunks = required_calls
    else:
        full, chunks = ask_both(client, tool_choice=tool_choice)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        schema = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
        jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name] or {})
    content, streamed_calls, finish = assemble(chunks)
    assert (content, finish) == (None, "tool_calls")
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in calls]


def test_a_forced_call_takes_response_format_beside_it(client, required_calls):
    """OpenAI accepts response_format with a forced call (instructor sends both): the reply is
    the call, shaped by the tool's schema alone, the same as without response_format."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for response_format in ({"type": "json_object"}, schema):
        choice = ask(client, tool_choice="required", response_format=response_format).choices[0]
        expected = required_calls[0].choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in expected
        ]
        assert choice.finish_reason == "tool_calls"


def test_two_parallel_calls_and_only_one_when_not_parallel(client):
    full, chunks, single = run_together(
        lambda: ask(client, tools=TOOLS[:2], tool_choice="required"),
        lambda: list(ask(client, stream=True, tools=TOOLS[:2], tool_choice="required")),
        lambda: ask(client, tool_choice="required", parallel_tool_calls=False),
    )
    calls = full.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] * 2  # recorded for this prompt
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "London"]
    assert assemble(chunks)[1] == [(c.function.name, c.function.arguments) for c in calls]
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_call_ends_its_arguments_when_the_schema_lists_its_properties(client):
    """A schema as users write it, without ``additionalProperties``: SmolLM2 followed
    ``"city": "Paris"`` with invented properties until ``max_tokens`` (8041 tokens with the
    chat default), leaving invalid JSON."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(client, tools=[tool], tool_choice=named, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls"
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    assert list(arguments) == ["city"] and isinstance(arguments["city"], str)


def test_a_response_format_schema_ends_its_objects(client):
    """``strict`` or not, a json_schema whose object lists ``name`` and ``age`` went on with
    invented properties (``"gender"``, ``"occupation"``, ...) until max_tokens."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        temperature=0,
        max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert list(json.loads(choice.message.content)) == ["name", "age"]


def test_a_parameterless_tool_gets_empty_arguments(client):
    named = {"type": "function", "function": {"name": "ping"}}
    full, chunks = ask_both(client, tool_choice=named)
    call = full.choices[0].message.tool_calls[0]
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
    streamed_call = assemble(chunks)[1]
    assert streamed_call == [("ping", call.function.arguments)]


def test_a_two_turn_exchange(client, required_calls):
    call = required_calls[0].choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18, "unit": "celsius"}'},
    ]
    answer, auto = run_together(
        lambda: ask(client, messages=messages, tool_choice="none", max_tokens=40),
        lambda: ask(client, messages=messages, max_tokens=40),  # auto: text or calls
    )
    answer, auto = answer.choices[0], auto.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # auto: either calls of the declared tools with JSON arguments, or text
    names = {tool["function"]["name"] for tool in TOOLS}
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        for call in auto.message.tool_calls:
            assert call.function.name in names and isinstance(
                json.loads(call.function.arguments), dict
            )
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")


def post(server, body: dict) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **body}
    return httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
        ),
        ({"messages": ASK + [{"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ],
)
def test_tool_requests_that_cannot_work_are_400s(server, body, param):
    response = post(server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    stats = httpx.get(server.url_for("debug", "stats")).json()
    assert stats["num_running"] == 0 and stats["num_kv_blocks_used"] == 0
