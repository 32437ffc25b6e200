"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
before the first call is the content."""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolParser,
    call_from_json,
    held_back,
    no_call_yet,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``--tool-call-parser hermes``: calls between ``<tool_call>`` tags (a block whose JSON has
    no name is dropped; text after the calls is not content)."""

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(START)
        if first < 0:
            return no_call_yet(text, START, final)
        parsed = ParsedToolOutput(text[:first].rstrip())
        start = first
        while start >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            closed = end >= 0
            if not closed:
                end = len(text) - (0 if final else held_back(text, END))
            parsed.calls.append(call_from_json(text[body_start:end], final or closed))
            start = text.find(START, end + len(END)) if closed else -1
        return parsed
