"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the
real ``anthropic`` SDK against ``pyxllm serve`` on the default model (with an API key, and
hermes' tool parser for ``tool_choice`` auto), each answer checked against chat completions'
answer to the same conversation (greedy, so equal): a plain turn, several turns with a system
prompt, streaming (the events in Anthropic's order, the SDK's accumulated message equal to
the unstreamed one), stop sequences, a forced tool call and its result's turn, token counts,
``x-api-key``, and the errors in Anthropic's shape; without a server, a stream the engine
stops, and the error shape of the middleware's answers."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import partial_json_parser
import pytest
from pydantic import TypeAdapter

from pyxllm.engine.input_processor import EngineRequest
from pyxllm.entrypoints.anthropic.messages_input import chat_messages, chat_request
from pyxllm.entrypoints.anthropic.messages_output import content_blocks
from pyxllm.entrypoints.anthropic.messages_stream import MessagesEvents
from pyxllm.entrypoints.anthropic.protocol import CountTokensRequest, ToolChoiceParam, ToolParam
from pyxllm.entrypoints.openai.chat.choices import chat_message
from pyxllm.entrypoints.openai.chat.reasoning.think_tags import ThinkTagReasoningParser
from pyxllm.entrypoints.openai.chat.serving import PreparedChat
from pyxllm.entrypoints.openai.chat.tools import ToolPlan
from pyxllm.entrypoints.openai.errors import OpenAIError, error_response
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams
from tests.entrypoints.openai.chat.test_reasoning import TextTokenizer
from tests.utils import RemoteServer, run_together, tool_calling_server_args

MODEL = "smollm2-anthropic"
KEY = "sk-anthropic-5e6f7a"
GREEDY = {"temperature": 0}  # the SDK has no temperature argument: sent as an extra field
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": TOOL["name"], "description": TOOL["description"], "parameters": WEATHER},
}
SYSTEM = "Answer in one short sentence."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    args = [*tool_calling_server_args(MODEL), "--api-key", KEY]
    with RemoteServer(args, env={"PYXLLM_API_KEY": ""}) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    root = server.url_for("")
    return anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def create(client, **kwargs):
    return client.messages.create(**{"model": MODEL, "extra_body": GREEDY, **kwargs})


def streamed(client, **kwargs):
    """The SDK's events of a streamed answer and the message it accumulated."""
    with client.messages.stream(**{"model": MODEL, "extra_body": GREEDY, **kwargs}) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def chat(openai_client, messages, **kwargs):
    body = {"model": MODEL, "messages": messages, "temperature": 0, **kwargs}
    return openai_client.chat.completions.create(**body)


def post(server, body: dict, path: str = "messages", **headers) -> httpx.Response:
    headers = {"x-api-key": KEY, **headers}
    return httpx.post(server.url_for("v1", path), json=body, headers=headers, timeout=60)


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each server-sent event of a streamed answer, as sent."""
    events, name = [], None
    body = {"model": MODEL, "stream": True, **GREEDY, **body}
    url = server.url_for("v1", "messages")
    with httpx.stream("POST", url, json=body, headers={"x-api-key": KEY}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def expected_stop(finish_reason: str) -> str:
    return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[finish_reason]


def assert_usage_is_chats(usage, reference) -> None:
    """The prompt's tokens (those the prefix cache served apart) and the output's, as chat
    counts them."""
    assert usage.input_tokens + usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert usage.output_tokens == reference.usage.completion_tokens
    assert usage.input_tokens >= 1 and usage.cache_creation_input_tokens == 0


def test_a_plain_turn_is_answered_as_chat_answers_it(client, openai_client):
    message, reference = run_together(
        lambda: create(client, max_tokens=12, messages=[{"role": "user", "content": QUESTION}]),
        lambda: chat(openai_client, [{"role": "user", "content": QUESTION}], max_tokens=12),
    )
    choice = reference.choices[0]
    assert (message.type, message.role, message.model, message.id[:4]) == (
        "message",
        "assistant",
        MODEL,
        "msg_",
    )
    [block] = message.content
    assert block.type == "text" and block.text == choice.message.content and block.text
    assert message.stop_reason == expected_stop(choice.finish_reason)
    assert message.stop_sequence is None
    assert_usage_is_chats(message.usage, reference)


def test_several_turns_with_a_system_prompt_as_text_or_blocks(client, openai_client):
    """``system`` (a text, or text blocks) is chat's system message; the turns, texts or text
    blocks (joined by newlines), chat's messages."""
    first = chat(openai_client, [{"role": "user", "content": "Name a colour."}], max_tokens=8)
    said = first.choices[0].message.content
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "Name another one."},
    ]
    as_blocks = [
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": [{"type": "text", "text": said}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Name another one.",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    system_blocks = [{"type": "text", "text": SYSTEM}]
    as_text, blocks, reference = run_together(
        lambda: create(client, max_tokens=10, system=SYSTEM, messages=turns),
        lambda: create(client, max_tokens=10, system=system_blocks, messages=as_blocks),
        lambda: chat(openai_client, [{"role": "system", "content": SYSTEM}, *turns], max_tokens=10),
    )
    choice = reference.choices[0]
    for message in (as_text, blocks):
        assert [b.text for b in message.content] == [choice.message.content]
        assert message.stop_reason == expected_stop(choice.finish_reason)
        assert_usage_is_chats(message.usage, reference)


def test_a_streamed_answer_is_the_unstreamed_one_in_anthropics_events(client, server):
    ask = {"max_tokens": 12, "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    message, (sdk_events, final), events = run_together(
        lambda: create(client, **ask),
        lambda: streamed(client, **ask),
        lambda: raw_events(server, ask),
    )
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names  # each event's name is its type
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)  # each the SDK's type
    for name, data in events:
        assert name == "ping" or adapter.validate_python(data).type == name
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == sum(
        message.usage.model_dump(include={"input_tokens", "cache_read_input_tokens"}).values()
    )
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": "", "citations": None},
    }
    texts = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(delta["type"] == "text_delta" for delta in texts)
    assert "".join(delta["text"] for delta in texts) == message.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": message.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == message.usage.output_tokens
    # the SDK's stream helper accumulates the same message
    assert [e.type for e in sdk_events][0] == "message_start"
    exclude = {"id": True, "usage": {"input_tokens", "cache_read_input_tokens"}}
    assert final.model_dump(exclude=exclude) == message.model_dump(exclude=exclude)
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens) == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens
    )


def test_stop_sequences_end_the_text_before_them(client, openai_client):
    """A stop sequence taken from the free answer ends it there: ``stop_reason``
    ``stop_sequence`` and the sequence named, streamed or not, the text chat's with ``stop``."""
    messages = [{"role": "user", "content": QUESTION}]
    free = create(client, max_tokens=12, messages=messages).content[0].text
    stop = free.split()[2]  # a word in the middle of the answer
    ask = {"max_tokens": 12, "messages": messages, "stop_sequences": [stop, "\n\n\n"]}
    message, (_, final), reference = run_together(
        lambda: create(client, **ask),
        lambda: streamed(client, **ask),
        lambda: chat(openai_client, messages, max_tokens=12, stop=[stop, "\n\n\n"]),
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    text = message.content[0].text
    assert text == reference.choices[0].message.content and stop not in text
    assert free.startswith(text + stop)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == text


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}],
)
def test_a_forced_tool_call_and_its_results_turn(client, openai_client, tool_choice):
    """A forced call (``tool`` or ``any``) is a ``tool_use`` block whose ``input`` validates
    against the schema and is chat's call; streamed, its ``input_json_delta`` pieces add up to
    it. Its ``tool_result`` goes back as chat's tool message."""
    ask = {
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [TOOL],
        "tool_choice": tool_choice,
    }
    chat_choice = "required"
    if tool_choice["type"] == "tool":
        chat_choice = {"type": "function", "function": {"name": "get_weather"}}
    message, (events, final), reference = run_together(
        lambda: create(client, **ask),
        lambda: streamed(client, **ask),
        lambda: chat(
            openai_client,
            ask["messages"],
            max_tokens=60,
            tools=[CHAT_TOOL],
            tool_choice=chat_choice,
            parallel_tool_calls=False,
        ),
    )
    [call] = message.content
    [expected] = reference.choices[0].message.tool_calls
    assert (call.type, call.name) == ("tool_use", "get_weather") and call.id
    assert call.input == json.loads(expected.function.arguments)
    jsonschema.validate(call.input, WEATHER)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", call.name, call.input)
    ]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == call.input and final.stop_reason == "tool_use"

    # the result's turn: tool_use and tool_result blocks are chat's tool call and tool message
    result = '{"temperature": 21}'
    turns = [
        *ask["messages"],
        {
            "role": "assistant",
            "content": [call.model_dump(include={"type", "id", "name", "input"})],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": result},
                {"type": "text", "text": "Is it warm?"},
            ],
        },
    ]
    chat_turns = [
        *ask["messages"],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
        {"role": "user", "content": "Is it warm?"},
    ]
    answer, chat_answer = run_together(
        lambda: create(
            client, max_tokens=10, messages=turns, tools=[TOOL], tool_choice={"type": "auto"}
        ),
        lambda: chat(openai_client, chat_turns, max_tokens=10, tools=[CHAT_TOOL]),
    )
    said = chat_answer.choices[0].message
    assert [b.text for b in answer.content if b.type == "text"] == [said.content] * bool(
        said.content
    )
    assert [b.name for b in answer.content if b.type == "tool_use"] == [
        c.function.name for c in said.tool_calls or ()
    ]
    assert answer.stop_reason == expected_stop(chat_answer.choices[0].finish_reason)
    assert_usage_is_chats(answer.usage, chat_answer)


def test_a_call_cut_short_by_max_tokens_holds_what_was_written(client, openai_client):
    """``max_tokens`` inside a forced call: ``stop_reason`` ``max_tokens``, and ``input`` what
    chat's cut arguments hold (their last string as far as it was written)."""
    ask = {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    message, reference = run_together(
        lambda: create(client, **ask),
        lambda: chat(
            openai_client,
            ask["messages"],
            max_tokens=8,
            tools=[CHAT_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
    )
    choice = reference.choices[0]
    [expected] = choice.message.tool_calls
    assert choice.finish_reason == "length" and message.stop_reason == "max_tokens"
    [call] = message.content
    assert call.type == "tool_use" and call.input
    assert call.input == partial_json_parser.loads(expected.function.arguments)
    with pytest.raises(ValueError):  # cut short indeed
        json.loads(expected.function.arguments)


def test_count_tokens_is_the_prompt_a_message_reports(client):
    """``count_tokens`` of a request is the prompt its answer's usage counts (with the tools
    offered, and without)."""
    plain = {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    tools = {
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    for ask in (plain, tools):
        counted = client.messages.count_tokens(model=MODEL, **ask)
        usage = create(client, max_tokens=2, **ask).usage
        assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=MODEL, **tools).input_tokens > (
        client.messages.count_tokens(model=MODEL, messages=tools["messages"]).input_tokens
    )


def test_the_api_key_goes_in_x_api_key_or_authorization(server):
    """Anthropic's SDK sends ``Authorization: Bearer`` (or ``x-api-key`` when given one); a
    missing or wrong key is a 401 ``authentication_error`` in Anthropic's shape."""
    root = server.url_for("")
    by_header = anthropic.Anthropic(
        base_url=root, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0
    )
    assert by_header.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
    )
    wrong = anthropic.Anthropic(base_url=root, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    for path in ("messages", "messages/count_tokens"):
        for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}):
            response = httpx.post(server.url_for("v1", path), json=body, headers=headers)
            assert response.status_code == 401
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
            assert "x-api-key" in error["error"]["message"]
    assert post(server, body).status_code == 200


HI = [{"role": "user", "content": "Hi"}]
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}


@pytest.mark.parametrize(
    ("body", "status", "error_type", "named"),
    [
        ({"messages": HI}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 0, "messages": HI}, 400, "invalid_request_error", "max_tokens"),
        (
            {"model": "claude-x", "max_tokens": 2, "messages": HI},
            404,
            "not_found_error",
            "claude-x",
        ),
        (
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "messages[0].content[1]: this model reads text only",
        ),
        (  # the chat request's message 4, part 1 is the request's turn 2, block 2
            {
                "max_tokens": 2,
                "system": "Be brief.",
                "messages": [
                    *HI,
                    {"role": "assistant", "content": [TOOL_USE]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                            {"type": "text", "text": "And this?"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                        ],
                    },
                ],
            },
            400,
            "invalid_request_error",
            "messages[2].content[2]: this model reads text only",
        ),
        (
            {
                "max_tokens": 2,
                "messages": HI,
                "thinking": {"type": "enabled", "budget_tokens": 2048},
            },
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            {"max_tokens": 2, "messages": [*HI, {"role": "assistant", "content": "Hel"}]},
            400,
            "invalid_request_error",
            "messages[1]",
        ),
        (
            {
                "max_tokens": 2,
                "messages": HI,
                "tools": [{"type": "web_search_20250305", "name": "s"}],
            },
            400,
            "invalid_request_error",
            "tools[0].type",
        ),
        (
            {"max_tokens": 2, "messages": HI, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {"max_tokens": 2, "messages": HI, "tools": [TOOL], "tool_choice": {"type": "tool"}},
            400,
            "invalid_request_error",
            "tool_choice.name",
        ),
    ],
)
def test_errors_take_anthropics_shape_naming_the_field(server, body, status, error_type, named):
    response = post(server, {"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()
    assert error == {
        "type": "error",
        "error": {"type": error_type, "message": error["error"]["message"]},
    }
    assert named in error["error"]["message"]


def test_the_sdk_raises_anthropics_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=2, messages=HI)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
    }
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [image]}])


# --- without a server -------------------------------------------------------------------------


def test_the_middlewares_errors_take_anthropics_shape_on_its_routes():
    """413 and 503 (the body limit, admission control) and 401 are answered in Anthropic's
    shape on its routes, in OpenAI's elsewhere."""
    for status, error_type in [
        (401, "authentication_error"),
        (413, "request_too_large"),
        (503, "overloaded_error"),
        (500, "api_error"),
    ]:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = json.loads(error_response("no", status, "x", path=path).body)
            assert body == {"type": "error", "error": {"type": error_type, "message": "no"}}
        body = json.loads(error_response("no", status, "x", path="/v1/chat/completions").body)
        assert body["error"]["code"] == status and body["error"]["param"] == "x"


def stream_of(*outputs: RequestOutput | Exception, reasoning=None) -> str:
    """The events a Messages stream sends for ``outputs`` (an exception: the engine raised),
    its text split by the ``reasoning`` parser if given."""
    request = EngineRequest("msg_1", [1, 2, 3], None, SamplingParams(max_tokens=8), 0.0)
    events = MessagesEvents(
        "msg_1", PreparedChat(request, reasoning, ToolPlan("none")), MODEL, lambda t: b""
    )
    sent = list(events.opening())
    for output in outputs:
        if isinstance(output, Exception):
            sent += events.failed(OpenAIError(str(output), 503))
            return "".join(sent)
        sent.append(events.update(output.outputs[0], output) or "")
    if outputs[-1].outputs[0].finish_reason is None:
        sent.append(events.aborted(0))
    sent += events.closing(None)
    return "".join(sent)


def test_a_stream_the_engine_stops_or_fails_ends_with_an_error_event():
    output = RequestOutput("msg_1", None, [1, 2, 3], [CompletionOutput(0, "Hel", [5])])
    for text, error_type in [
        (stream_of(output), "api_error"),
        (stream_of(output, RuntimeError("the engine is not healthy")), "overloaded_error"),
    ]:
        last = text.strip().split("\n\n")[-1]
        name, data = last.split("\n")
        assert name == "event: error"
        assert json.loads(data.removeprefix("data: "))["error"]["type"] == error_type
        assert "message_stop" not in text and "event: content_block_delta" in text


def parse_events(text: str) -> list:
    """The SDK's models of a stream's events (each validated), from their ``data:`` lines."""
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    return [
        adapter.validate_json(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ") and '"type":"ping"' not in line
    ]


def test_reasoning_streams_as_a_thinking_block_before_the_text():
    """With a reasoning parser, the thinking is a ``thinking`` block (``thinking_delta``s)
    before the ``text`` block, as the whole answer's content blocks have them."""
    parser = ThinkTagReasoningParser(TextTokenizer())
    texts = ["<think>Hmm", "<think>Hmm, Paris.</think>", "<think>Hmm, Paris.</think>Paris."]
    outputs = [
        RequestOutput("msg_1", None, [1, 2, 3], [CompletionOutput(0, text, [5] * (i + 1))])
        for i, text in enumerate(texts)
    ]
    outputs[-1].outputs[0].finish_reason = "stop"
    events = parse_events(stream_of(*outputs, reasoning=parser))
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    thinking = "".join(
        e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0
    )
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1)
    whole = content_blocks(chat_message(texts[-1], parser))
    assert [b.model_dump() for b in whole] == [
        {"type": "thinking", "thinking": thinking, "signature": ""},
        {"type": "text", "text": text, "citations": None},
    ]
    assert (thinking, text) == ("Hmm, Paris.", "Paris.")
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == 3


def test_blocks_become_chats_messages():
    """Each block type where chat has it: text joined, tool_use a call with JSON arguments,
    thinking the turn's reasoning, tool_result a tool message in its place (an error's text
    marked), a system turn a system message."""
    request = CountTokensRequest(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                    {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no g"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "So?"},
                ],
            },
            {"role": "system", "content": "Answer now."},
        ],
    )
    calls = [
        {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "A\nB"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": calls,
            "reasoning_content": "Look it up.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no g"},
        {"role": "user", "content": "So?"},
        {"role": "system", "content": "Answer now."},
    ]
    served = chat_request(request)
    assert served.tool_choice is None and served.parallel_tool_calls is True
    request.tools = [ToolParam(**TOOL)]
    for choice, expected, parallel in [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
    ]:
        request.tool_choice = ToolChoiceParam(**choice)
        served = chat_request(request)
        assert (served.tool_choice, served.parallel_tool_calls) == (expected, parallel)
    assert served.tools[0].function.parameters == WEATHER
