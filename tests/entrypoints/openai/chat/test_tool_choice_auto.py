"""Tools on a server started with no tool flags, and strict request fields: the tool-call parser
chosen from the chat template (the embedded model's, and templates in the style of Qwen's,
Llama 3's and others'), ``tool_choice`` left out (``auto``) with the real ``openai`` SDK,
``--tool-call-parser none``, unknown fields (a 400 naming them, or ignored with
``--ignore-unknown-fields``), llama.cpp's ``json_schema`` and ``grammar``, and ``tool_calls``
left out of a message without calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pyxllm.cli.main import parse_args
from pyxllm.entrypoints.openai.chat.tool_parsers import tool_parser_names
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import choose_tool_parser, resolve_tool_parser
from pyxllm.entrypoints.openai.chat.tools import template_messages
from pyxllm.entrypoints.openai.protocol import ChatCompletionToolParam
from tests.entrypoints.openai.chat.test_tool_calls import TOOLS, assemble
from tests.utils import RemoteServer, run_together

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Chat templates written in the style of each family, with the markers their real templates
# hold: Qwen2.5/Qwen3 describe the tools and ask for <tool_call> blocks; Llama 3.1-3.3 describe
# a {"name", "parameters"} JSON call under their header tokens; Qwen3-Coder writes XML inside
# <tool_call>; Mistral lists tools in [AVAILABLE_TOOLS] and answers after [TOOL_CALLS]; vLLM's
# pythonic templates (Llama 3.2, Llama 4) ask for [func_name1(params_name1=...)]; DeepSeek V3
# writes calls between its own <｜tool▁calls▁begin｜> tokens; vLLM's Phi-4-mini template asks
# for functools[...]; Granite 3 lists tools under <|start_of_role|>available_tools and answers
# after <|tool_call|>; gpt-oss (harmony) lists functions in a TypeScript namespace and writes
# a call as a commentary message to=functions.NAME ending in <|call|>; InternLM calls with
# <|action_start|><|plugin|>, which no parser reads.
_TURNS = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- endif %}"
)
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function call, return a json object "
    'within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}" + _TURNS
)
LLAMA3_STYLE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'Respond with a JSON call in the format {"name": function name, "parameters": dictionary '
    "of argument name and its value}.{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|eot_id|>{%- endif %}{%- for message in messages %}<|start_header_id|>"
    "{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}"
)
QWEN3_CODER_STYLE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n<function>"
    "<name>{{ tool.function.name }}</name></function>{%- endfor %}\n</tools>\nCall one as "
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{%- endif %}" + _TURNS
)
MISTRAL_STYLE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}[INST]{{ message.content }}[/INST]{%- endfor %}"
    "{#- a call is answered after [TOOL_CALLS] #}"
)

PYTHONIC_STYLE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nIf you decide to invoke "
    "any of the function(s), you MUST put it in the format of [func_name1(params_name1="
    "params_value1, params_name2=params_value2...), func_name2(params)]\nHere is a list of "
    "functions in JSON format that you can invoke.\n{{ tools | tojson }}<|eot_id|>"
    "{%- endif %}{%- for message in messages %}<|start_header_id|>{{ message.role }}"
    "<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endfor %}"
)
DEEPSEEK_STYLE = (
    "{%- if tools %}## Tools\n{{ tools | tojson }}\nCall a tool as <｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>{%- endif %}{%- for message in messages %}<｜{{ message.role }}｜>"
    "{{ message.content }}{%- endfor %}"
)
PHI4_MINI_STYLE = (
    "{%- if tools %}<|system|>If you decide to call functions, write them as functools[{"
    '"name": [function name], "arguments": [function arguments as JSON]}, ...]<|tool|>'
    "{{ tools | tojson }}<|/tool|><|end|>{%- endif %}{%- for message in messages %}<|"
    "{{ message.role }}|>{{ message.content }}<|end|>{%- endfor %}<|assistant|>"
)
GRANITE_STYLE = (
    "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
    "<|end_of_text|>{%- endif %}{%- for message in messages %}<|start_of_role|>"
    "{{ message.role }}<|end_of_role|>{{ message.content }}<|end_of_text|>{%- endfor %}"
    "{#- a call is answered after <|tool_call|> #}"
)
GPT_OSS_STYLE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace "
    "functions {\n{%- for tool in tools %}\n// {{ tool.function.description }}\ntype "
    "{{ tool.function.name }} = (_: {{ (tool.function.parameters or {}) | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif %}{%- for message in messages %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}<|start|>assistant "
    "to=functions.{{ call.function.name }}<|channel|>commentary json<|message|>"
    "{{ call.function.arguments }}<|call|>{%- endfor %}{%- else %}<|start|>{{ message.role }}"
    "<|message|>{{ message.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
INTERNLM_STYLE = (
    "{%- if tools %}<|im_start|>system name=<|plugin|>\n{{ tools | tojson }}<|im_end|>\n"
    "{%- endif %}{#- a call is <|action_start|><|plugin|>{...}<|action_end|> #}" + _TURNS
)


def test_the_embedded_template_gets_the_tools_in_a_system_message_read_by_hermes(
    hf_gguf_tokenizer,
):
    """The embedded SmolLM2 template does not render tools (rendered with them, they are not
    there), so pyxllm offers them in a system message asking for <tool_call> blocks: hermes."""
    template = hf_gguf_tokenizer.chat_template
    rendered = hf_gguf_tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False)
    assert "get_weather" not in rendered
    choice = choose_tool_parser(template)
    assert choice.name == "hermes" and "does not render tools" in choice.reason
    tools = [ChatCompletionToolParam(**tool) for tool in TOOLS]
    offered = hf_gguf_tokenizer.apply_chat_template(
        template_messages(ASK, tools, in_template=False), tokenize=False
    )
    assert "get_weather" in offered and "<tool_call>" in offered


def test_content_parts_stay_parts_and_a_tool_result_of_parts_is_its_text():
    """Messages of content parts (a vision-language model's template that loops over them):
    the tools' offer is one more text part of the system message, a tool result's text parts
    are its text (not the list written out)."""
    tools = [ChatCompletionToolParam(**tool) for tool in TOOLS]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Weather?"}]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "22 C"}, {"type": "text", "text": "sunny"}],
        },
    ]
    system, user, tool = template_messages(messages, tools, in_template=False)
    assert system["content"][0] == {"type": "text", "text": "Be brief."}
    assert system["content"][1]["type"] == "text" and "get_weather" in system["content"][1]["text"]
    assert user["content"] == messages[1]["content"]
    assert tool["content"] == "<tool_response>\n22 C\nsunny\n</tool_response>"


@pytest.mark.parametrize(
    "template, parser",
    [
        (QWEN_STYLE, "hermes"),
        (LLAMA3_STYLE, "llama3_json"),
        (QWEN3_CODER_STYLE, "qwen3_coder"),
        (MISTRAL_STYLE, "mistral"),
        (PYTHONIC_STYLE, "pythonic"),
        (DEEPSEEK_STYLE, "deepseek_v3"),
        (PHI4_MINI_STYLE, "phi4_mini_json"),
        (GRANITE_STYLE, "granite"),
        (GPT_OSS_STYLE, "openai"),
        (INTERNLM_STYLE, None),
    ],
)
def test_a_template_that_renders_tools_chooses_its_parser(hf_gguf_tokenizer, template, parser):
    rendered = hf_gguf_tokenizer.apply_chat_template(
        ASK, tools=TOOLS, chat_template=template, tokenize=False
    )
    assert "get_weather" in rendered  # the template itself renders the tools
    choice = choose_tool_parser(template)
    assert choice.name == parser and choice.reason
    assert choice.name is None or choice.name in tool_parser_names()


def test_the_tool_call_parser_flag():
    assert resolve_tool_parser("auto", QWEN_STYLE).name == "hermes"
    assert resolve_tool_parser("llama3_json", QWEN_STYLE).name == "llama3_json"
    assert resolve_tool_parser("none", QWEN_STYLE).name is None
    args, _ = parse_args(["serve"])
    assert args.tool_call_parser == "auto" and not args.enable_auto_tool_choice
    assert not args.ignore_unknown_fields
    with pytest.raises(SystemExit):
        parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "none"])
    with pytest.raises(SystemExit):
        parse_args(["serve", "--tool-call-parser", "qwen3_xml"])


# --- over HTTP: a server started with no tool flags -----------------------------------------

MODEL = "smollm2-default-tools"
SERVER_ARGS = ["--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-memory", "0.25"]
# A Hermes call, forced by a constraint beside the tools (auto leaves the output free), so
# that what the parser finds does not depend on what the tiny model would write.
FORCED_CALL = {
    "regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", '
    r'"unit": "celsius"\}\}\n</tool_call>'
}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, stream: bool = False, **kwargs):
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 48, **kwargs}
    return client.chat.completions.create(**body, stream=stream)


def post(server, body: dict) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **body}
    return httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=120)


def test_the_start_up_log_says_which_parser_and_why(server):
    assert (
        'tool_choice "auto": the hermes tool-call parser (the chat template does not render '
        "tools" in server.output()
    )


def test_tools_without_tool_choice_answer_streamed_as_unstreamed(client):
    """tool_choice left out (as LangChain and most agent frameworks send tools): a 200 with a
    well-formed message, calls of the declared tools or text, the same streamed."""
    full, chunks = run_together(
        lambda: chat(client, tools=TOOLS), lambda: list(chat(client, stream=True, tools=TOOLS))
    )
    choice = full.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    if calls:
        assert choice.finish_reason == "tool_calls"
        names = {tool["function"]["name"] for tool in TOOLS}
        assert all(name in names for name, _ in calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert assemble(chunks) == (choice.message.content, calls, choice.finish_reason)


def test_a_hermes_call_comes_back_as_tool_calls(client):
    full, chunks = run_together(
        lambda: chat(client, tools=TOOLS, extra_body={"structured_outputs": FORCED_CALL}),
        lambda: list(
            chat(client, stream=True, tools=TOOLS, extra_body={"structured_outputs": FORCED_CALL})
        ),
    )
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert assemble(chunks) == (None, [("get_weather", call.function.arguments)], "tool_calls")


def test_tool_calls_are_left_out_of_a_message_without_calls(server):
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        response = post(server, body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert "tool_calls" not in message and message["content"]


def test_an_unknown_field_is_a_400_naming_it(server, client):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {"grammar": 'root ::= "a"', "json_schema": schema, "totally_unknown_field": 3}
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "totally_unknown_field"
    assert "--ignore-unknown-fields" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={"vendor_extra": True})
    assert caught.value.body["param"] == "vendor_extra"
    for path, sent in (("/v1/completions", {"prompt": "Hi"}), ("/tokenize", {"prompt": "Hi"})):
        response = httpx.post(server.url_for(path), json={**sent, "nope": 1}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "nope"


# Nested objects of fixed keys, each with one key no version of the API has: (route, body, path)
NESTED_UNKNOWN = [
    ("/v1/chat/completions", {"stream": True, "stream_options": {"foo": 1}}, "stream_options.foo"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "text", "foo": 1}},
        "response_format.foo",
    ),
    (
        "/v1/chat/completions",
        {"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "foo": 1}}]},
        "tools[0].function.foo",
    ),
    (
        "/v1/chat/completions",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x", "foo": 1}}},
        "tool_choice.function.foo",
    ),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"foo": 1}}, "stream_options.foo"),
    (
        "/v1/responses",
        {"input": "Hi", "text": {"format": {"type": "text", "foo": 1}}},
        "text.format.foo",
    ),
    (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi", "foo": 1}]},
        "messages[0].foo",
    ),
    (
        "/v1/messages/count_tokens",
        {"messages": ASK, "tool_choice": {"type": "auto", "foo": 1}},
        "tool_choice.foo",
    ),
]


@pytest.mark.parametrize("path, body, named", NESTED_UNKNOWN)
def test_an_unknown_nested_field_is_a_400_naming_its_path(server, path, body, named):
    body = {
        "model": MODEL,
        **({} if "input" in body or "prompt" in body else {"messages": ASK}),
        **body,
    }
    response = httpx.post(server.url_for(path), json=body, timeout=120)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith(f"{named}: unrecognized request argument"), message


def test_free_form_nested_objects_keep_their_keys(server):
    """JSON Schemas, ``logit_bias``, ``chat_template_kwargs``, a message's own keys (for the
    template) and an echoed tool call's keys are not request objects: any key is taken."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "x-vendor": 1}
    tool = {**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": schema}}
    call = {
        "id": "c1",
        "type": "function",
        "index": 0,
        "function": {"name": "f", "arguments": "{}"},
    }
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = {
        "messages": messages,
        "tools": [tool],
        "tool_choice": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "logit_bias": {"1": 0.5},
        "chat_template_kwargs": {"anything": {"nested": True}},
    }
    response = post(server, body)
    assert response.status_code == 200, response.text


def test_llama_cpp_json_schema_and_grammar_constrain_the_output(server):
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    asked = [{"role": "user", "content": "Name a city, as JSON."}]
    schema, gbnf, completion = run_together(
        lambda: post(server, {"messages": asked, "json_schema": city, "max_tokens": 64}),
        lambda: post(server, {"grammar": 'root ::= "yes" | "no"', "max_tokens": 8}),
        lambda: httpx.post(
            server.url_for("v1", "completions"),
            json={"prompt": "Is it raining?", "grammar": 'root ::= "yes" | "no"', "max_tokens": 8},
            timeout=120,
        ),
    )
    for response in (schema, gbnf, completion):
        assert response.status_code == 200, response.text
    choice = schema.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), city)
    assert gbnf.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert completion.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize(
    "body, params",
    [
        ({"grammar": "root ::= nothing_defined"}, {"grammar"}),
        ({"json_schema": {"type": "nonsense"}}, {"json_schema"}),
        (
            {"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}},
            {"json_schema", "response_format"},
        ),
        ({"grammar": 'root ::= "a"', "tools": TOOLS, "tool_choice": "required"}, {"grammar"}),
    ],
)
def test_json_schema_and_grammar_that_cannot_work_are_400s(server, body, params):
    response = post(server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in params


# --- a server started with --tool-call-parser none --ignore-unknown-fields ------------------


def test_tool_call_parser_none_refuses_auto_and_unknown_fields_can_be_ignored():
    args = [*SERVER_ARGS, "--tool-call-parser", "none", "--ignore-unknown-fields"]
    with RemoteServer(args) as remote:
        refused, ignored = run_together(
            lambda: post(remote, {"tools": TOOLS}),
            lambda: post(
                remote, {"totally_unknown_field": 3, "response_format": {"type": "text", "foo": 1}}
            ),
        )
        log = remote.output()
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tool_choice" and "--tool-call-parser none" in error["message"]
    assert ignored.status_code == 200, ignored.text
    assert ignored.json()["choices"][0]["message"]["content"]
    assert 'tool_choice "auto": refused' in log
    assert (
        "request fields ignored (not known to pyxllm): totally_unknown_field, response_format.foo"
        in log
    )


def test_enable_auto_tool_choice_fails_start_up_without_a_parser():
    """vLLM's flag makes "auto" a promise: a chat template whose call format no parser reads
    stops the server at start-up, naming the flag and why, before the model loads (a
    ``--chat-template`` is known from the flags)."""
    args = [*SERVER_ARGS, "--chat-template", INTERNLM_STYLE, "--enable-auto-tool-choice"]
    with pytest.raises(RuntimeError, match="exited with status 2") as caught:
        with RemoteServer(args):
            pass
    assert "error: --enable-auto-tool-choice: no tool-call parser: the chat template renders " in (
        str(caught.value)
    )
    assert "KV blocks" not in str(caught.value)  # the engine's start-up line: no model loaded


def test_enable_auto_tool_choice_is_checked_on_the_template_it_will_serve():
    """The check the server runs before the model loads (and again on the tokenizer's own
    template once loaded): a template no parser reads fails only with the flag, a template a
    parser reads passes with it, and a parser named by hand passes whatever the template."""
    from pyxllm.entrypoints.openai.chat.serving import choose_auto_tool_parser
    from pyxllm.entrypoints.openai.server_options import ServerOptions

    promised = ServerOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice: no tool-call parser"):
        choose_auto_tool_parser(promised, INTERNLM_STYLE)
    assert choose_auto_tool_parser(ServerOptions(), INTERNLM_STYLE).name is None
    assert choose_auto_tool_parser(promised, QWEN_STYLE).name == "hermes"
    named = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    assert choose_auto_tool_parser(named, INTERNLM_STYLE).name == "qwen3_coder"


def test_a_parser_named_by_hand_reads_typed_xml_calls():
    """--tool-call-parser qwen3_coder: an XML call (forced by a constraint, so that it does not
    depend on what the tiny model would write) comes back with its value typed by the request's
    tool schema, streamed as unstreamed."""
    alarm = {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}}},
        },
    }
    forced = {
        "regex": r"<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n"
        r"</function>\n</tool_call>"
    }
    body = {"tools": [alarm], "max_tokens": 80, "extra_body": {"structured_outputs": forced}}
    with RemoteServer([*SERVER_ARGS, "--tool-call-parser", "qwen3_coder"]) as remote:
        client = remote.openai_client()
        full, chunks = run_together(
            lambda: chat(client, **body), lambda: list(chat(client, stream=True, **body))
        )
        log = remote.output()
    assert 'tool_choice "auto": the qwen3_coder tool-call parser' in log
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("set_alarm", '{"hour": 7}')
    assert assemble(chunks) == (None, [("set_alarm", '{"hour": 7}')], "tool_calls")


# --- agent frameworks, as they send tools (tool_choice left out) -----------------------------


def test_langchain_bind_tools_reads_the_call_streamed_or_not(server):
    """LangChain's ``ChatOpenAI.bind_tools`` with its default ``tool_choice`` (none sent): the
    call comes back as the message's ``tool_calls``, and streamed chunks add up to it."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.base_url,
        api_key="none",
        temperature=0,
        max_tokens=48,
        extra_body={"structured_outputs": FORCED_CALL},
    ).bind_tools([get_weather])
    question = "What is the weather in Paris?"
    message, chunks = run_together(lambda: llm.invoke(question), lambda: list(llm.stream(question)))
    [call] = message.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    # and free (no constraint): a well-formed answer, a call of the tool or text
    free = llm.bind(extra_body={}, max_tokens=8).invoke(question)
    assert free.tool_calls or free.content


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_run_a_function_tool(server, api):
    """The ``openai-agents`` SDK (its Chat Completions model, ``tool_choice`` left out, the call
    forced by a constraint beside it; and its default, the Responses API, which has no such
    field: ``tool_choice="required"``): the agent's call reaches the function, whose result
    ends the run."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        seen.append((city, unit))
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none")
    if api == "chat_completions":
        model_class, forcing = (
            OpenAIChatCompletionsModel,
            {"extra_body": {"structured_outputs": FORCED_CALL}},
        )
    else:
        model_class, forcing = OpenAIResponsesModel, {"tool_choice": "required"}
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model_class(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=48, **forcing),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    [(city, unit)] = seen
    assert result.final_output == f"sunny in {city}"
    if api == "chat_completions":
        assert (city, unit) == ("Paris", "celsius")
