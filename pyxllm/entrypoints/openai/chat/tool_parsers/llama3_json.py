"""Llama 3.x's JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;``; a reply that does not start with ``{`` is
content."""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolParser,
    call_from_json,
    json_value_span,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``--tool-call-parser llama3_json``."""

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        body = text.removeprefix(PYTHON_TAG) if text.startswith(PYTHON_TAG) else text
        stripped = body.lstrip()
        if not stripped:
            return ParsedToolOutput(text if final else "")
        if not stripped.startswith("{"):
            return ParsedToolOutput(text)
        return ParsedToolOutput("", json_sequence(body, final, separators=";"))


def json_sequence(text: str, final: bool, separators: str = ",", start: int = 0):
    """The calls of consecutive JSON objects from ``text[start:]`` (whitespace and
    ``separators`` between them); the last may be incomplete."""
    calls, pos = [], start
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls
        end = json_value_span(text, pos)
        if end is None:
            calls.append(call_from_json(text[pos:], final))
            return calls
        calls.append(call_from_json(text[pos:end], True))
        pos = end
