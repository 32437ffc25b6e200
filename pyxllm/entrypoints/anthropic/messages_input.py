"""A Messages request as the chat completion request that serves it.

``system`` becomes a system message (text blocks joined by newlines, as chat joins text parts);
each turn's text blocks its text, an assistant's ``tool_use`` blocks its ``tool_calls`` (the
``input`` as JSON arguments) and ``thinking`` blocks its ``reasoning_content``; a user's
``tool_result`` blocks become ``tool`` messages (``is_error`` results prefixed ``Error: ``), in
their place among the turn's text. ``tools`` become function tools (``input_schema`` their
``parameters``), ``tool_choice`` ``auto``/``any``/``tool``/``none`` chat's
``auto``/``required``/a named function/``none``, ``stop_sequences`` chat's ``stop``. What
pyxllm cannot do is a 400 naming the field (:func:`check_supported`, and the blocks).
"""

from __future__ import annotations

import json
from typing import Any

from pyxllm.entrypoints.anthropic.protocol import (
    ContentBlockParam,
    MessagesInput,
    MessagesRequest,
    TextBlockParam,
)
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolParam,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)

# Fields pyxllm cannot honour, with the values that ask for nothing more than leaving them out
# (anything else is refused), and why.
UNSUPPORTED = {
    "output_config": ((None,), None),
    "speed": ((None, "standard"), "there is one speed"),
    "mcp_servers": ((None, []), "pyxllm connects to no MCP server"),
    "context_management": ((None,), None),
    "container": ((None,), "pyxllm runs no code"),
    "inference_geo": ((None,), None),
    "service_tier": ((None, "auto", "standard_only"), "there is one service tier, standard"),
}
# Anthropic's block types pyxllm refuses by name, with why.
REFUSED_BLOCKS = {
    "document": "document blocks are not supported",
    "redacted_thinking": "redacted_thinking blocks are not supported (pyxllm cannot read "
    "encrypted reasoning)",
}


def _refuse(field: str, value: Any, why: str | None = None) -> OpenAIError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return OpenAIError(
        f"{field}: {shown} is not supported" + (f" ({why})" if why else ""),
        400,
        field.split(".")[0].split("[")[0],
    )


def check_supported(request: MessagesInput) -> None:
    """400 naming the first field of ``request`` that asks for what pyxllm cannot do: the
    :data:`UNSUPPORTED` fields, ``thinking`` but ``{"type": "disabled"}`` or ``{"type":
    "enabled", "budget_tokens": N}`` (``N >= 0``: chat's ``thinking_token_budget``, which
    needs ``--reasoning-parser``; Anthropic's own floor of 1024 is not enforced), a tool's
    ``defer_loading``, ``allowed_callers`` or ``input_examples``, a ``max_tokens`` below 1,
    and no messages."""
    for name, (neutral, why) in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if value not in neutral:
            raise _refuse(name, value, why)
    thinking = request.thinking
    if thinking is not None and thinking != {"type": "disabled"}:
        budget = thinking_budget(thinking)
        if budget is None:
            raise _refuse(
                "thinking", thinking, 'send {"type": "enabled", "budget_tokens": N} or disabled'
            )
        if budget < 0:
            raise OpenAIError(
                f"thinking.budget_tokens: must be >= 0, got {budget}", 400, "thinking"
            )
    for i, tool in enumerate(request.tools or ()):
        for name in ("defer_loading", "allowed_callers", "input_examples"):
            value = getattr(tool, name)
            if value not in (None, False, []):
                raise _refuse(f"tools[{i}].{name}", value)
    if isinstance(request, MessagesRequest) and request.max_tokens < 1:
        raise OpenAIError(
            f"max_tokens: must be at least 1, got {request.max_tokens}", 400, "max_tokens"
        )
    if not request.messages:  # as Anthropic's API: a system prompt alone is no conversation
        raise OpenAIError("messages: at least one message is required", 400, "messages")


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """The ``budget_tokens`` of ``{"type": "enabled", "budget_tokens": N}`` (an int), else
    ``None``."""
    if thinking is None or set(thinking) != {"type", "budget_tokens"}:
        return None
    if thinking["type"] != "enabled":
        return None
    budget = thinking["budget_tokens"]
    return budget if isinstance(budget, int) and not isinstance(budget, bool) else None


def chat_request(request: MessagesInput) -> ChatCompletionRequest:
    """The chat completion request that serves ``request`` (a token count's too: then it has
    no sampling fields).

    Raises:
        OpenAIError: a block, tool or ``tool_choice`` pyxllm cannot serve, a block in a turn
            that cannot hold it, or a last turn of the assistant (400 naming the field).
    """
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        fields = {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "stream": request.stream,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "thinking_token_budget": thinking_budget(request.thinking),
            "kv_transfer_params": request.kv_transfer_params,
        }
    choice = request.tool_choice
    return ChatCompletionRequest(
        model=request.model,
        messages=chat_messages(request),
        tools=_tools(request),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        **fields,
    )


def chat_messages(request: MessagesInput) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages (see the module docstring).

    Raises:
        OpenAIError: see :func:`chat_request`.
    """
    return [message for message, _ in _chat_messages_and_paths(request)]


def message_paths(request: MessagesInput) -> list[tuple[str, list[str]]]:
    """Where each of :func:`chat_messages`' messages comes from in ``request``: its turn
    (``"system"``, ``"messages[2]"``) and, for a message of content parts, each part's block
    (``"messages[2].content[3]"``: a turn's ``tool_result`` blocks become messages of their
    own, so a part's index and a turn's can differ from the chat message's). Errors the chat
    handler raises about a chat message are renamed with it."""
    return [paths for _, paths in _chat_messages_and_paths(request)]


def _chat_messages_and_paths(request: MessagesInput) -> list[tuple[dict, tuple[str, list[str]]]]:
    converted: list[tuple[dict, tuple[str, list[str]]]] = []
    if request.system:
        converted.append(
            ({"role": "system", "content": _system_text(request.system)}, ("system", []))
        )
    for i, turn in enumerate(request.messages):
        where = f"messages[{i}]"
        blocks = turn.content
        if isinstance(blocks, str):
            converted.append(({"role": turn.role, "content": blocks}, (where, [])))
        elif turn.role == "assistant":
            converted.append((_assistant_message(blocks, where), (where, [])))
        else:
            converted += [
                (message, (where, parts))
                for message, parts in _user_messages(blocks, turn.role, where)
            ]
    if request.messages and request.messages[-1].role == "assistant":
        raise OpenAIError(
            f"messages[{len(request.messages) - 1}]: a last turn of the assistant (to be "
            "continued) is not supported; end with a user turn",
            400,
            "messages",
        )
    return converted


def _system_text(system: str | list[TextBlockParam]) -> str:
    return system if isinstance(system, str) else "\n".join(block.text for block in system)


def _check_block(block: ContentBlockParam, where: str, allowed: tuple[str, ...]) -> None:
    """400 for a block of a type refused by name, or one this turn's role cannot hold."""
    why = REFUSED_BLOCKS.get(block.type)
    if why is not None:
        raise OpenAIError(f"{where}: {why}", 400, "messages")
    if block.type not in allowed:
        raise OpenAIError(
            f"{where}.type: a block of type {block.type!r} is not supported here "
            f"(this turn takes {', '.join(allowed)})",
            400,
            "messages",
        )


def _required(value: Any, field: str, where: str, kind: str) -> Any:
    if value is None:
        raise OpenAIError(f"{where}.{field}: required in a {kind} block", 400, "messages")
    return value


def _assistant_message(blocks: list[ContentBlockParam], where: str) -> dict[str, Any]:
    """An assistant turn: its text, its calls (``tool_use``), its reasoning (``thinking``)."""
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        _check_block(block, at, ("text", "tool_use", "thinking"))
        if block.type == "text":
            texts.append(_required(block.text, "text", at, "text"))
        elif block.type == "thinking":
            reasoning.append(_required(block.thinking, "thinking", at, "thinking"))
        else:
            arguments = json.dumps(_required(block.input, "input", at, "tool_use"))
            function = {
                "name": _required(block.name, "name", at, "tool_use"),
                "arguments": arguments,
            }
            call_id = _required(block.id, "id", at, "tool_use")
            calls.append({"id": call_id, "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _user_messages(
    blocks: list[ContentBlockParam], role: str, where: str
) -> list[tuple[dict[str, Any], list[str]]]:
    """A user (or system) turn: a message of its consecutive text and image blocks (text joined
    by newlines; with an image, OpenAI content parts in their order), and a ``tool`` message per
    ``tool_result`` block (a user's only), in their order; each with its parts' block paths
    (see :func:`message_paths`)."""
    allowed = ("text", "image", "tool_result") if role == "user" else ("text",)
    messages: list[tuple[dict[str, Any], list[str]]] = []
    parts: list[dict[str, Any]] = []
    paths: list[str] = []

    def flush() -> None:
        if any(part["type"] == "image_url" for part in parts):
            messages.append(({"role": role, "content": list(parts)}, list(paths)))
        else:
            text = "\n".join(p["text"] for p in parts)
            messages.append(({"role": role, "content": text}, []))
        parts.clear()
        paths.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        _check_block(block, at, allowed)
        if block.type in ("text", "image"):
            if block.type == "text":
                parts.append({"type": "text", "text": _required(block.text, "text", at, "text")})
            else:
                parts.append(_image_part(block, at))
            paths.append(at)
            continue
        if parts:
            flush()
        call_id = _required(block.tool_use_id, "tool_use_id", at, "tool_result")
        text = _result_text(block.content, f"{at}.content")
        if block.is_error:
            text = f"Error: {text}"
        messages.append(({"role": "tool", "tool_call_id": call_id, "content": text}, []))
    if parts or not blocks:
        flush()
    return messages


def _image_part(block: ContentBlockParam, where: str) -> dict[str, Any]:
    """An ``image`` block as an OpenAI ``image_url`` part: a ``base64`` source as a data URL,
    a ``url`` source as its URL (fetched as the chat API fetches it); a Files API source is
    refused."""
    source = _required(block.source, "source", where, "image")
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        data = source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise OpenAIError(
                f"{where}.source: a base64 image needs media_type and data", 400, "messages"
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise OpenAIError(
        f"{where}.source.type: {kind!r} is not supported (served: base64, url)", 400, "messages"
    )


def _result_text(content: str | list[ContentBlockParam] | None, where: str) -> str:
    """A tool result's text (its text blocks joined by newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, block in enumerate(content):
        at = f"{where}[{k}]"
        _check_block(block, at, ("text",))
        texts.append(_required(block.text, "text", at, "text"))
    return "\n".join(texts)


def _tools(request: MessagesInput) -> list[ChatCompletionToolParam] | None:
    if request.tools is None:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type not in (None, "custom"):
            raise _refuse(f"tools[{i}].type", tool.type, "pyxllm serves custom tools only")
        if tool.input_schema is None:
            raise OpenAIError(f"tools[{i}].input_schema: Field required", 400, "tools")
        function = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.input_schema,
            strict=tool.strict,
        )
        tools.append(ChatCompletionToolParam(function=function))
    return tools


def _tool_choice(request: MessagesInput) -> str | NamedToolChoice | None:
    choice = request.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError('tool_choice.name: required with type "tool"', 400, "tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
