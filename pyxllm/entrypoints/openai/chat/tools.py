"""Tool calling on the request side: a request's tool mode, the constraint that enforces
``required`` and named calls, and the messages and tools the chat template sees.

- ``tool_choice`` ``none`` (the default without ``tools``): free text. ``auto`` (the default
  with ``tools``): the model decides, and the server's tool-call parser finds its calls (by
  default chosen from the chat template, :mod:`.tool_parsers.auto`; a 400 saying why when there
  is none). ``required``: a
  grammar makes the model write a JSON array of 1 to :data:`MAX_PARALLEL_TOOL_CALLS` calls
  (1 with ``parallel_tool_calls: false``), each ``{"name": <a tool's name>, "arguments":
  <that tool's parameters>}``. A named function: a grammar makes the model write its arguments.
  Even a model that has never seen a tool returns calls whose arguments validate; ``arguments``
  is the JSON text as the model wrote it (the grammars allow bounded whitespace, which small
  models write better JSON with: compact JSON made SmolLM2 stop after one of two calls).
- A chat template that renders ``tools`` gets them as ``tools=`` (Qwen's, Llama 3's); one that
  does not (the default SmolLM2's) gets them described in a system message, with the format to
  answer in (:func:`tools_system_text`: Hermes-style ``<tool_call>`` tags, what
  ``--tool-call-parser hermes`` reads), and earlier calls and results written in that format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyxllm.entrypoints.openai.chat.tool_parsers import ToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.constrained import (
    NamedCallParser,
    RequiredCallsParser,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.hermes import END, START
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolParam
from pyxllm.sampling_params import StructuredOutputsParams

# Most calls a tool_choice "required" reply holds (so that the array always ends).
MAX_PARALLEL_TOOL_CALLS = 8
# A function without parameters takes exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's reply is read for calls.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        parser: what finds the calls in the reply (``None`` in mode ``none``).
        constraint: the grammar of ``required`` and named calls.
        limit: the most calls returned.
    """

    mode: str
    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None
    limit: int | None = None


def parameters_schema(tool: ChatCompletionToolParam) -> dict[str, Any]:
    """The JSON Schema of a tool's arguments (its objects closed when compiled, see
    :func:`~pyxllm.engine.structured_output.json_schema.closed_objects`)."""
    return tool.function.parameters or NO_PARAMETERS


def plan_tools(
    request: ChatCompletionRequest,
    auto_parser: ToolParser | None,
    no_parser_reason: str = "the server has no tool-call parser",
) -> ToolPlan:
    """The request's :class:`ToolPlan`.

    Args:
        auto_parser: the parser of the server's ``tool_choice: "auto"`` (``None``: refused).
        no_parser_reason: why there is none, for the 400 (see
            :class:`~.tool_parsers.auto.ToolParserChoice`).

    Raises:
        OpenAIError: ``tool_choice`` without ``tools``, two tools with one name, a named
            function that is not among the tools, or ``auto`` on a server without a parser.
    """
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice: requires tools", 400, "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError("tools: two tools have the same function name", 400, "tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none")
    limit = 1 if request.parallel_tool_calls is False else MAX_PARALLEL_TOOL_CALLS
    if choice == "auto":
        if auto_parser is None:
            raise OpenAIError(
                f'tool_choice: "auto" (the default with tools) cannot be served: '
                f"{no_parser_reason}; start the server with --tool-call-parser NAME, or send "
                '"required", a named function or "none"',
                400,
                "tool_choice",
            )
        return ToolPlan("auto", auto_parser.for_tools(tools), None, limit)
    if choice == "required":
        calls = [_call_schema(t) for t in tools]
        schema = {"type": "array", "minItems": 1, "maxItems": limit, "items": {"anyOf": calls}}
        spec = StructuredOutputsParams(json=schema, field="tools")
        return ToolPlan("required", RequiredCallsParser(), spec, limit)
    name = choice.function.name
    if name not in names:
        raise OpenAIError(f"tool_choice: no tool is named {name!r}", 400, "tool_choice")
    index = names.index(name)
    spec = StructuredOutputsParams(
        json=parameters_schema(tools[index]), field=f"tools[{index}].function.parameters"
    )
    return ToolPlan("named", NamedCallParser(name), spec, 1)


def _call_schema(tool: ChatCompletionToolParam) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": parameters_schema(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_specs(request: ChatCompletionRequest) -> list[StructuredOutputsParams]:
    """Each tool's parameters as a constraint to compile (a schema that does not compile is a
    400 naming ``tools[i].function.parameters``)."""
    return [
        StructuredOutputsParams(json=parameters_schema(t), field=f"tools[{i}].function.parameters")
        for i, t in enumerate(request.tools or [])
    ]


def tools_system_text(tools: list[ChatCompletionToolParam]) -> str:
    """The system text that offers ``tools`` to a model whose chat template has no tools."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return (
        "You can use the following tools, each described as a JSON object:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To use one, reply with a JSON object holding the tool's name and its arguments, "
        f'inside tags, one block per call:\n{START}\n{{"name": "tool name", "arguments": '
        f"{{...}}}}\n{END}"
    )


def template_messages(
    messages: list[dict[str, Any]], tools: list[ChatCompletionToolParam], in_template: bool
) -> list[dict[str, Any]]:
    """The messages as the chat template should see them.

    A template that renders tools (``in_template``) gets assistant calls with their arguments
    as objects (as Qwen's and Llama's templates expect) and ``""`` for a null content; another
    gets earlier calls and tool results written as text in the Hermes format, and, when
    ``tools`` are offered, :func:`tools_system_text` in the system message.

    Raises:
        OpenAIError: a ``tool`` message without ``tool_call_id``.
    """
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if message["role"] == "tool" and not message.get("tool_call_id"):
            raise OpenAIError(
                f"messages[{i}].tool_call_id: a tool message answers a call by its id",
                400,
                f"messages[{i}].tool_call_id",
            )
        if in_template:
            if calls:
                message["tool_calls"] = [_with_object_arguments(c) for c in calls]
            message["content"] = message.get("content") or ""
        else:
            message["content"] = _as_text(message, calls)
        out.append(message)
    if tools and not in_template:
        offer = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            content = out[0]["content"]
            if isinstance(content, list):  # content parts, for a template that loops over them
                content = [*content, {"type": "text", "text": f"\n\n{offer}"}]
            else:
                content = f"{content}\n\n{offer}"
            out[0] = {**out[0], "content": content}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError):
        pass  # not JSON: the template gets the text
    return {**call, "function": function}


def _as_text(message: dict[str, Any], calls: list[dict[str, Any]]) -> str | list:
    content = message.get("content") or ""
    if message["role"] == "tool":  # a result is text, however its parts came
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if p.get("type") == "text")
        return f"<tool_response>\n{content}\n</tool_response>"
    blocks = []
    for call in calls:
        arguments = _with_object_arguments(call)["function"]["arguments"]
        body = json.dumps({"name": call["function"]["name"], "arguments": arguments})
        blocks.append(f"{START}\n{body}\n{END}")
    if isinstance(content, list):  # content parts, for a template that loops over them
        return [*content, *({"type": "text", "text": b} for b in blocks)]
    return "\n".join(filter(None, [content, *blocks]))
