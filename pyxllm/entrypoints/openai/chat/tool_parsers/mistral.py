"""Mistral's calls, after the ``[TOOL_CALLS]`` token: a JSON array of ``{"name": ...,
"arguments": {...}}`` objects (Mistral 7B v0.3, Mixtral, Mistral Nemo), or each call as
``[TOOL_CALLS]name[ARGS]{...}`` (the tokenizers of Mistral Small 3.2, Magistral and Devstral;
an optional ``[CALL_ID]id`` before ``[ARGS]`` is skipped); the text before the first
``[TOOL_CALLS]`` is the content.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens in Mistral's tokenizers: an ``auto`` request
keeps special tokens in its text so that the parser sees them (see
:attr:`~.base.ToolParser.needs_special_tokens`).
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolCallState,
    ToolParser,
    arguments_text,
    held_back,
    no_call_yet,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json import json_sequence

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralToolParser(ToolParser):
    """``--tool-call-parser mistral``."""

    tags = (TOOL_CALLS, ARGS)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return no_call_yet(text, TOOL_CALLS, final)
        parsed = ParsedToolOutput(text[:first].rstrip())
        body = first + len(TOOL_CALLS)
        rest = text[body:].lstrip()
        if rest.startswith(("[", "{")):  # the JSON array (or one object)
            start = len(text) - len(rest) + (1 if rest[0] == "[" else 0)
            parsed.calls = json_sequence(text, final, separators=",", start=start)
            return parsed
        while body >= 0:  # name[ARGS]{...}, each after its own [TOOL_CALLS]
            following = text.find(TOOL_CALLS, body)
            if following >= 0:
                end = following
            else:
                end = len(text) - (0 if final else held_back(text, TOOL_CALLS))
            call = _named_call(text[body:end], final or following >= 0)
            if call is None:
                break
            parsed.calls.append(call)
            body = following + len(TOOL_CALLS) if following >= 0 else -1
        return parsed


def _named_call(text: str, complete: bool) -> ToolCallState | None:
    """The call ``name[ARGS]{...}`` (``name[CALL_ID]id[ARGS]{...}``); ``None`` until its name
    is whole, and for text that is not a call."""
    args = text.find(ARGS)
    if args < 0:
        return None
    name = text[:args].split(CALL_ID, 1)[0].strip()
    if not name:
        return None
    start = args + len(ARGS)
    start += len(text) - start - len(text[start:].lstrip())
    return ToolCallState(name=name, arguments=arguments_text(text, start, complete))
