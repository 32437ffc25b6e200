"""The Responses API (``POST /v1/responses``) through the real ``openai`` SDK against
``pyxllm serve`` on the default model, each answer checked against chat completions' answer to
the same conversation (greedy, so equal): text and item inputs, instructions, streaming (the
SDK's own stream helper accumulates and checks the events), a conversation by
``previous_response_id``, the store (retrieve, delete, ``store: false``), function calls,
``text.format``, logprobs, every raw body and event against the SDK's types, and the 400s and
404s; without a server, a stream that fails or is cut short, and the store's bounds."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter

from pyxllm.engine.input_processor import EngineRequest
from pyxllm.entrypoints.openai.chat.serving import PreparedChat
from pyxllm.entrypoints.openai.chat.tools import ToolPlan
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.responses.run import ResponseRun, ResponsesEvents
from pyxllm.entrypoints.openai.responses.serving import ResponseStore
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams
from tests.utils import RemoteServer, run_together, tool_calling_server_args

MODEL = "smollm2-responses"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "river": {"type": "string"}},
    "required": ["name", "river"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(tool_calling_server_args(MODEL)) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "temperature": 0, **kwargs})


def chat(client, messages, **kwargs):
    body = {"model": MODEL, "messages": messages, "temperature": 0, **kwargs}
    return client.chat.completions.create(**body)


def streamed(client, **kwargs):
    """The events of a streamed response as the SDK's stream helper passes them on (it checks
    their order and accumulates them), and its final response."""
    with client.responses.stream(**{"model": MODEL, "temperature": 0, **kwargs}) as stream:
        events = list(stream)
    return events, events[-1].response


def without_ids(response) -> list[dict]:
    """The output items less their random ids (equal for equal generations)."""
    return [
        item.model_dump(exclude={"id", "call_id"}, exclude_none=True) for item in response.output
    ]


def split_logprobs(items: list[dict]) -> tuple[list[dict], list[tuple[str, float]]]:
    """Output items (as :func:`without_ids` gives them) less their text parts' logprobs, and
    those logprobs as ``(token, logprob)``, the top ones' after each token's own."""
    pairs = []
    for item in items:
        for part in item.get("content", []):
            for entry in part.pop("logprobs", []):
                pairs.append((entry["token"], entry["logprob"]))
                pairs += [(top["token"], top["logprob"]) for top in entry.get("top_logprobs", [])]
    return items, pairs


def post(server: RemoteServer, body: dict, path: str = "responses") -> httpx.Response:
    return httpx.post(server.url_for("v1", path), json={"model": MODEL, **body}, timeout=60)


def test_text_input_is_answered_as_chat_answers_it_streamed_or_not(client):
    """``instructions`` + ``input`` text is chat's system + user message: the same text, usage,
    finish and logprobs, unstreamed and streamed (events numbered 0, 1, ..., the text deltas
    adding up to the text)."""
    ask = {
        "instructions": "Answer in one short sentence.",
        "input": "What is the capital of France?",
        "max_output_tokens": 12,
        "top_p": 0.9,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    messages = [
        {"role": "system", "content": ask["instructions"]},
        {"role": "user", "content": ask["input"]},
    ]
    response, (events, final), reference = run_together(
        lambda: create(client, **ask),
        lambda: streamed(client, **ask),
        lambda: chat(
            client,
            messages,
            max_completion_tokens=12,
            top_p=0.9,
            logprobs=True,
            top_logprobs=2,
        ),
    )
    choice = reference.choices[0]
    assert response.output_text == choice.message.content and response.output_text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        reference.usage.prompt_tokens,
        reference.usage.completion_tokens,
    )
    assert response.usage.total_tokens == reference.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0, 0.9, 12)
    assert response.instructions == ask["instructions"] and response.object == "response"
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    [message] = response.output
    assert (message.type, message.role, message.id[:4]) == ("message", "assistant", "msg_")
    logprobs = [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in message.content[0].logprobs]
    expected = choice.logprobs.content  # batched together: equal up to float rounding
    assert [(t, n) for t, _, n in logprobs] == [(lp.token, 2) for lp in expected]
    assert [p for _, p, _ in logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == f"response.{response.status}"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == response.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [t for t, _, _ in logprobs]
    sent = [lp.token for e in deltas for lp in e.logprobs]  # the last token (EOS) has no text
    assert sent == [t for t, _, _ in logprobs][: len(sent)] and len(sent) >= len(deltas)
    # the two ran at once, batched as their arrivals fell: the same tokens, the logprobs equal
    # up to float rounding (bfloat16 matmuls do not promise a row the same sums in any batch)
    (final_items, final_logprobs), (items, item_logprobs) = (
        split_logprobs(without_ids(r)) for r in (final, response)
    )
    assert final_items == items
    assert [t for t, _ in final_logprobs] == [t for t, _ in item_logprobs]
    assert [p for _, p in final_logprobs] == pytest.approx([p for _, p in item_logprobs], abs=1e-4)
    cache_blind = {"input_tokens_details"}  # the second time, the prompt is in the prefix cache
    assert final.usage.model_dump(exclude=cache_blind) == response.usage.model_dump(
        exclude=cache_blind
    )
    assert final.status == response.status


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client):
    """``input_tokens_details.cached_tokens``: none the first time a prompt is seen, whole
    blocks of it (16 tokens) when it comes again, streamed or not."""
    text = "Summarize this line: " + "the cat sat on the warm mat by the door. " * 8
    first = create(client, input=text, max_output_tokens=2)
    again = create(client, input=text, max_output_tokens=2)
    _, streamed_again = streamed(client, input=text, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0
    for response in (again, streamed_again):
        cached = response.usage.input_tokens_details.cached_tokens
        assert 0 < cached < response.usage.input_tokens and cached % 16 == 0


def test_a_conversation_goes_on_from_previous_response_id(client):
    """``previous_response_id`` continues the stored conversation (its input and output, not
    its instructions); the same turns sent as input items give the same answer."""
    first = create(client, instructions="Be brief.", input="Name a colour.", max_output_tokens=8)
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another one."},
    ]
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Name a colour."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": first.output_text}],
        },
        {"role": "user", "content": "Name another one."},
    ]
    second, as_items, reference = run_together(
        lambda: create(
            client, previous_response_id=first.id, input="Name another one.", max_output_tokens=8
        ),
        lambda: create(client, input=items, max_output_tokens=8),
        lambda: chat(client, turns, max_completion_tokens=8),
    )
    assert second.output_text == reference.choices[0].message.content
    assert second.usage.input_tokens == reference.usage.prompt_tokens  # no instructions
    assert second.previous_response_id == first.id and second.instructions is None
    assert as_items.output_text == second.output_text
    third = create(
        client, previous_response_id=second.id, input="And a third?", max_output_tokens=4
    )
    turns += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And a third?"},
    ]
    assert (
        third.output_text == chat(client, turns, max_completion_tokens=4).choices[0].message.content
    )


def test_stored_responses_are_retrieved_deleted_or_not_kept(client):
    response = create(client, input="Hi!", max_output_tokens=2, metadata={"k": "v"})
    assert response.store is True and response.metadata == {"k": "v"}
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, previous_response_id=response.id, input="Again", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    unkept = create(client, input="Hi!", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_are_chat_tool_calls_streamed_or_not(client, tool_choice):
    """A forced call comes back as a ``function_call`` item with chat's name and arguments
    (valid against the schema); streamed, argument deltas add up to them."""
    ask = {
        "input": "What is the weather in Paris?",
        "tools": [{"type": "function", **TOOL}],
        "tool_choice": tool_choice,
        "max_output_tokens": 60,
    }
    chat_choice = tool_choice
    if isinstance(tool_choice, dict):
        chat_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    response, (events, final), reference = run_together(
        lambda: create(client, **ask),
        lambda: streamed(client, **ask),
        lambda: chat(
            client,
            [{"role": "user", "content": ask["input"]}],
            tools=[{"type": "function", "function": TOOL}],
            tool_choice=chat_choice,
            max_completion_tokens=60,
        ),
    )
    calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    expected = [
        (c.function.name, c.function.arguments) for c in reference.choices[0].message.tool_calls
    ]
    assert calls == expected and calls
    for _, arguments in calls:
        jsonschema.validate(json.loads(arguments), WEATHER)
    assert response.status == "completed"
    assert all(i.call_id.startswith("call_") and i.id.startswith("fc_") for i in response.output)
    assert without_ids(final) == without_ids(response)
    by_item: dict[str, str] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            by_item[event.item_id] = by_item.get(event.item_id, "") + event.delta
    assert [by_item[i.id] for i in final.output if i.type == "function_call"] == [
        a for _, a in calls
    ]

    # the call's result goes back as a function_call_output item, as a tool message in chat
    call = next(i for i in response.output if i.type == "function_call")
    result = '{"temperature": 21}'
    answer, chat_answer = run_together(
        lambda: create(
            client,
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
            tools=ask["tools"],
            max_output_tokens=10,
        ),
        lambda: chat(
            client,
            [
                {"role": "user", "content": ask["input"]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": result},
            ],
            tools=[{"type": "function", "function": TOOL}],
            max_completion_tokens=10,
        ),
    )
    message = chat_answer.choices[0].message
    assert answer.output_text == (message.content or "")
    assert [i.name for i in answer.output if i.type == "function_call"] == [
        c.function.name for c in message.tool_calls or ()
    ]


def test_text_format_beside_a_forced_call_is_served(client):
    """OpenAI takes ``text.format`` with a forced call (instructor sends both): the answer is
    the call, shaped by its tool's schema."""
    response = create(
        client,
        input="What is the weather in London?",
        tools=[{"type": "function", **TOOL}],
        tool_choice="required",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == TOOL["name"], response.output
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])


def test_text_format_json_schema_is_chat_response_format(client):
    ask = "Describe Paris as JSON with its name and river."
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    response, reference = run_together(
        lambda: create(client, input=ask, text=text, max_output_tokens=60),
        lambda: chat(
            client,
            [{"role": "user", "content": ask}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY},
            },
            max_completion_tokens=60,
        ),
    )
    assert response.output_text == reference.choices[0].message.content
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), CITY)


def sse_events(text: str) -> list[dict]:
    """The ``data`` of each event of a Responses stream, checking its ``event:`` line."""
    events = []
    for block in filter(None, text.split("\n\n")):
        kind, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1]['type']}"
    return events


def test_bodies_and_events_have_the_sdk_shapes(server):
    """Every body and event, raw, validates against the ``openai`` package's own types."""
    tool = {"tools": [{"type": "function", **TOOL}], "tool_choice": "required"}
    logprobs = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    bodies = [
        {"input": "Hi!", "max_output_tokens": 4, "temperature": 0, "stream": True, **logprobs},
        {"input": "Weather in Oslo?", "max_output_tokens": 40, "stream": True, **tool},
        {"input": "Hi!", "max_output_tokens": 2, "metadata": {"k": "v"}},
    ]
    answers = run_together(*[lambda body=body: post(server, body) for body in bodies])
    events = [e for answer in answers[:2] for e in sse_events(answer.text)]
    assert {"response.output_text.delta", "response.function_call_arguments.delta"} <= {
        e["type"] for e in events
    }
    event_type = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for event in events:
        event_type.validate_python(event)
    stored = httpx.get(server.url_for("v1", "responses", answers[2].json()["id"]))
    for body in (answers[2].json(), stored.json()):
        openai.types.responses.Response.model_validate(body)
    assert stored.json() == answers[2].json()


def scripted_stream() -> tuple[ResponsesEvents, list]:
    """A stream's events object for a made-up request, and the responses it reports done."""
    request = EngineRequest("resp_1", [1, 2, 3], None, SamplingParams(max_tokens=8), 0.0)
    run = ResponseRun("resp_1", {"model": "m", "text": {"format": {"type": "text"}}}, 3, None)
    done: list = []
    prepared = PreparedChat(request, None, ToolPlan("none"))
    return ResponsesEvents(run, prepared, "m", done.append, lambda token_id: b""), done


def test_a_stream_that_fails_or_is_cut_short_ends_with_response_failed():
    stream, done = scripted_stream()
    partial = CompletionOutput(0, "Hel", [7])
    output = RequestOutput("r", None, [1, 2], [partial])
    text = "".join([*stream.opening(), stream.update(partial, output)])
    text += "".join(stream.failed(OpenAIError("the engine died", 503)))
    events = sse_events(text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == events[-1]["response"]["error"]["message"] == "the engine died"
    assert done == []  # a failed stream is not kept

    stream, done = scripted_stream()  # the engine's outputs end without a finish reason
    text = "".join([*stream.opening(), stream.update(partial, output), stream.aborted(0)])
    last = sse_events(text + "".join(stream.closing(None)))[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["output"][0]["content"][0]["text"] == "Hel"
    assert [r.status for r in done] == ["failed"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        (
            {"tools": [{"type": "function", **TOOL}], "tool_choice": {"type": "file_search"}},
            "tool_choice",
        ),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # no --reasoning-parser
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4096}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].parameters",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    response = post(server, {"input": "Hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "BadRequestError"


def test_unknown_ids_and_models_are_404s(server):
    for response, param in [
        (
            post(server, {"input": "Hi", "previous_response_id": "resp_nope"}),
            "previous_response_id",
        ),
        (post(server, {"input": "Hi", "model": "another"}), "model"),
        (httpx.get(server.url_for("v1", "responses", "resp_nope")), "response_id"),
        (httpx.delete(server.url_for("v1", "responses", "resp_nope")), "response_id"),
    ]:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == param


def test_the_store_drops_the_oldest_past_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [{"role": "user", "content": name}])
    assert (store.get("a"), [store.get(n).body["id"] for n in "bc"]) == (None, ["b", "c"])
    size = store.get("c").size
    store = ResponseStore(max_responses=10, max_chars=2 * size)
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [{"role": "user", "content": name}])
    assert [n for n in "abc" if store.get(n)] == ["b", "c"] and store.chars == 2 * size
    store.put("big", {"id": "big"}, [{"role": "user", "content": "x" * 3 * size}])
    assert store.get("big") is None and store.get("c") is not None  # too big to keep at all
    assert store.delete("c") and not store.delete("c") and store.chars == size
