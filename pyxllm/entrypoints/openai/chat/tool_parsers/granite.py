"""Granite 3's calls: the reply is a JSON array of ``{"name": ..., "arguments": {...}}`` objects
after ``<|tool_call|>`` (Granite 3.0, 3.1-3.3's templates) or ``<tool_call>``; a reply that is
not such an array is content."""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import ParsedToolOutput, ToolParser
from pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json import json_sequence

TOOL_CALL_TOKEN, TOOL_CALL_STRING = "<|tool_call|>", "<tool_call>"
TAGS = (TOOL_CALL_TOKEN, TOOL_CALL_STRING)


class GraniteToolParser(ToolParser):
    """``--tool-call-parser granite``."""

    tags = (TOOL_CALL_TOKEN,)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        body = text.lstrip()
        tag = next((tag for tag in TAGS if body.startswith(tag)), "")
        body = body[len(tag) :].lstrip()
        if not final and (not body or (not tag and any(t.startswith(body) for t in TAGS))):
            return ParsedToolOutput("")  # nothing yet, or what may begin a tag
        if not body.startswith("["):
            return ParsedToolOutput(text)
        start = len(text) - len(body) + 1
        return ParsedToolOutput("", json_sequence(text, final, separators=",", start=start))
