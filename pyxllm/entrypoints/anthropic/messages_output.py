"""What chat completions' code makes of a reply (reasoning split off, tool calls found, finish
reason), in Anthropic's words: content blocks, ``stop_reason``, ``usage``."""

from __future__ import annotations

import json
from typing import Any

import partial_json_parser

from pyxllm.entrypoints.anthropic.protocol import (
    ContentBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from pyxllm.entrypoints.openai.protocol import ChatMessage


def stop_reason(
    finish_reason: str | None, matched: str | int | None
) -> tuple[StopReason, str | None] | None:
    """``(stop_reason, stop_sequence)`` of chat's ``finish_reason`` (``tool_calls`` once calls
    were found) and the engine's ``stop_reason`` (``matched``: the stop string that ended the
    text, or a stop token id); ``None`` for a request the engine stopped (``abort``)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop":
        if isinstance(matched, str):
            return "stop_sequence", matched
        return "end_turn", None
    return None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input``: its JSON arguments as an object. Arguments cut short (``max_tokens``
    came first) give what they hold so far, their last value as written (a string's start);
    ``{}`` for arguments that are not a JSON object, which the parsers and the forced calls'
    grammars do not write."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        try:
            value = partial_json_parser.loads(arguments)
        except Exception:  # noqa: BLE001 - not even the start of a JSON value
            return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: ChatMessage) -> list[ContentBlock]:
    """The content of a whole reply: its reasoning (``thinking``), its text, its calls
    (``tool_use``), in that order, each only when there is one."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or ():
        function = call.function
        blocks.append(
            ToolUseBlock(id=call.id, name=function.name, input=tool_input(function.arguments))
        )
    return blocks


def message_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
    """The ``usage`` of a request whose prompt had ``prompt_tokens``, ``cached_tokens`` of them
    served from the prefix cache."""
    return Usage(
        input_tokens=prompt_tokens - cached_tokens,
        output_tokens=output_tokens,
        cache_read_input_tokens=cached_tokens,
    )
