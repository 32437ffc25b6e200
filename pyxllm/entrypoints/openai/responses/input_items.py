"""A Responses request as the chat completion request that serves it.

The Responses API is served by chat completions' code (:mod:`..chat.serving`): ``instructions``
become a system message, ``input`` items chat messages (function calls an assistant turn's
``tool_calls``, function call outputs ``tool`` turns, reasoning items the assistant turn's
``reasoning_content``, which templates such as Qwen3's render), ``tools``/``tool_choice``
chat's tools, ``text.format`` chat's ``response_format``, ``max_output_tokens``
``max_completion_tokens``, ``include``'s logprobs chat's ``logprobs`` and ``reasoning.effort``
chat's ``thinking_token_budget`` (:data:`REASONING_EFFORT_BUDGETS`; it needs
``--reasoning-parser``); with a vision-language model, ``input_image`` parts chat's
``image_url`` parts. A field or item that
asks for something pyxllm cannot do is a 400 naming it (:func:`check_supported`).
"""

from __future__ import annotations

from typing import Any

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolParam,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)
from pyxllm.entrypoints.openai.responses.protocol import (
    INCLUDE_LOGPROBS,
    ResponseInputItem,
    ResponseInputPart,
    ResponsesRequest,
)

# Fields of the Responses API pyxllm cannot honour, with the values that ask for nothing more
# than leaving them out (anything else is refused).
UNSUPPORTED = {
    "background": ((None, False), "responses run in the foreground"),
    "service_tier": ((None, "auto", "default"), "there is one service tier, default"),
    "truncation": ((None, "disabled"), "input over the context is a 400, never truncated"),
    "conversation": ((None,), "use previous_response_id"),
    "prompt": ((None,), "stored prompt templates are OpenAI's"),
    "context_management": ((None,), None),
    "moderation": ((None,), None),
    "prompt_cache_retention": ((None,), "the prefix cache keeps blocks while memory allows"),
    "prompt_cache_options": ((None,), None),
    "background_options": ((None,), None),
    "image": ((None,), None),
    "access_programs": ((None,), None),
}
# ``reasoning.effort`` as a thinking_token_budget: the budgets vLLM's thinking-budget work
# proposed for its effort levels (low 1024, medium 2048, high 8192 reasoning tokens).
REASONING_EFFORT_BUDGETS = {"low": 1024, "medium": 2048, "high": 8192}
# Text part types whose ``text`` is served.
TEXT_PARTS = ("input_text", "output_text")


def _refuse(field: str, value: Any, why: str | None = None) -> OpenAIError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return OpenAIError(
        f"{field}: {shown} is not supported" + (f" ({why})" if why else ""),
        400,
        field.split(".")[0].split("[")[0],
    )


def check_supported(request: ResponsesRequest) -> None:
    """400 naming the first field of ``request`` that asks for what pyxllm cannot do: the
    :data:`UNSUPPORTED` fields, ``reasoning`` settings but an ``effort`` of
    :data:`REASONING_EFFORT_BUDGETS`, a ``text.verbosity`` but ``medium``,
    ``include`` values but ``message.output_text.logprobs``, ``stream_options`` without
    ``stream`` or with obfuscation."""
    for name, (neutral, why) in UNSUPPORTED.items():
        value = getattr(request, name)
        if value not in neutral:
            raise _refuse(name, value, why)
    if request.reasoning is not None:
        for name, value in request.reasoning.model_dump(exclude_none=True).items():
            if name == "effort" and value in REASONING_EFFORT_BUDGETS:
                continue
            why = (
                f"one of {', '.join(REASONING_EFFORT_BUDGETS)} is"
                if name == "effort"
                else "the model reasons as its template says"
            )
            raise _refuse(f"reasoning.{name}", value, why)
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise _refuse("text.verbosity", request.text.verbosity)
    for value in request.include or ():
        if value != INCLUDE_LOGPROBS:
            raise _refuse("include", value, f"only {INCLUDE_LOGPROBS!r} is")
    if request.stream_options is not None:
        if not request.stream:
            raise OpenAIError(
                "stream_options: only allowed when stream is true", 400, "stream_options"
            )
        if request.stream_options.include_obfuscation:
            raise _refuse("stream_options.include_obfuscation", True)


def chat_request(
    request: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat completion request that serves ``request``, whose ``conversation`` (chat
    messages: an earlier response's, then :func:`input_messages` of ``input``) follows
    ``instructions`` as a system message.

    Raises:
        OpenAIError: a tool or ``tool_choice`` pyxllm cannot serve (400 naming it).
    """
    instructions = [{"role": "system", "content": request.instructions}]
    messages = (instructions if request.instructions else []) + conversation
    logprobs = INCLUDE_LOGPROBS in (request.include or ()) or request.top_logprobs is not None
    effort = request.reasoning.effort if request.reasoning is not None else None
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        tools=_tools(request),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else None,
        thinking_token_budget=REASONING_EFFORT_BUDGETS.get(effort),
        kv_transfer_params=request.kv_transfer_params,
    )


def input_messages(
    items: str | list[ResponseInputItem] | None,
    images: bool = False,
    sources: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """``input`` as chat messages: a text is one user message; items in order, the
    assistant's consecutive items (reasoning, message, function calls) joined into one turn.

    With ``images`` (a vision-language model), a user or system message holding
    ``input_image`` parts keeps its parts as chat parts (``input_image``'s ``image_url`` as an
    ``image_url`` part, text parts as text), which the chat handler reads; ``sources`` then
    gets, for each such message, its index among the returned messages -> its ``input`` index
    (to name ``input[i].content[j]`` in the chat handler's errors).

    Raises:
        OpenAIError: an item type, role or content part pyxllm cannot serve (an image for a
            text model, or one given by ``file_id``), or an item without a field it needs (400
            naming ``input[i]...``).
    """
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            role = {"developer": "system"}.get(item.role or "", item.role)
            if role not in ("user", "system", "assistant"):
                raise _refuse(f"{where}.role", item.role)
            if images and role != "assistant" and _has_image(item.content):
                if sources is not None:
                    sources[len(messages)] = i
                messages.append({"role": role, "content": _parts(item.content, where)})
                continue
            text = _text(item.content, f"{where}.content")
            if role == "assistant":
                turn = _assistant_turn(messages)
                turn["content"] = (turn["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name = _required(item, "call_id", where), _required(item, "name", where)
            call = {"name": name, "arguments": item.arguments or "{}"}
            tool_call = {"id": call_id, "type": "function", "function": call}
            _assistant_turn(messages).setdefault("tool_calls", []).append(tool_call)
        elif kind == "function_call_output":
            call_id = _required(item, "call_id", where)
            text = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            if item.encrypted_content:
                raise OpenAIError(
                    f"{where}.encrypted_content: not supported (pyxllm encrypts no reasoning)",
                    400,
                    "input",
                )
            parts = item.content if item.content is not None else item.summary
            texts = [parts] if isinstance(parts, str) else [p.text or "" for p in parts or ()]
            turn = _assistant_turn(messages)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + "\n".join(texts)
        else:
            raise _refuse(f"{where}.type", item.type)
    return messages


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message at the end of ``messages``, appended when there is none."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _required(item: ResponseInputItem, field: str, where: str) -> str:
    value = getattr(item, field)
    if not value:
        raise OpenAIError(
            f"{where}.{field}: required for an item of type {item.type}", 400, "input"
        )
    return value


def _has_image(content: str | list[ResponseInputPart] | None) -> bool:
    return isinstance(content, list) and any(p.type == "input_image" for p in content)


def _parts(content: list[ResponseInputPart], where: str) -> list[dict[str, Any]]:
    """A message's Responses parts as chat content parts (text and ``image_url``)."""
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            url = getattr(part, "image_url", None)
            if not isinstance(url, str) or not url:
                raise _refuse(
                    f"{where}.content[{j}]",
                    part.model_dump(exclude_none=True),
                    "an input_image needs an image_url (a data: URL, file:// or http(s)); "
                    "file_id is OpenAI's file store",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif part.type in TEXT_PARTS and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        else:
            raise _refuse(f"{where}.content[{j}].type", part.type, "text and image parts only")
    return parts


def _text(content: str | list[ResponseInputPart] | None, where: str) -> str:
    """The text of a message's content (text parts joined by newlines, as chat does)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise _refuse(f"{where}[{j}].type", part.type, "only text parts are served")
        texts.append(part.text)
    return "\n".join(texts)


def _tools(request: ResponsesRequest) -> list[ChatCompletionToolParam] | None:
    if request.tools is None:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type != "function":
            raise _refuse(f"tools[{i}].type", tool.type, "pyxllm serves function tools only")
        if not tool.name:
            raise OpenAIError(f"tools[{i}].name: required", 400, "tools")
        function = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        tools.append(ChatCompletionToolParam(function=function))
    return tools


def _tool_choice(request: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise _refuse("tool_choice", choice.model_dump(exclude_none=True))
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    text_format = request.text and request.text.format
    if text_format is None:
        return None
    schema = None
    if text_format.type == "json_schema":
        schema = JsonSchemaFormat(
            name=text_format.name,
            description=text_format.description,
            schema=text_format.json_schema,
            strict=text_format.strict,
        )
    return ResponseFormat(type=text_format.type, json_schema=schema)
