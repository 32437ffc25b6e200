"""Phi-4-mini's calls: ``functools[{"name": ..., "arguments": {...}}, ...]``, a JSON array after
the word ``functools``; the text before it is the content."""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolParser,
    no_call_yet,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json import json_sequence

START = "functools["


class Phi4MiniToolParser(ToolParser):
    """``--tool-call-parser phi4_mini_json``."""

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(START)
        if first < 0:
            return no_call_yet(text, START, final)
        calls = json_sequence(text, final, separators=",", start=first + len(START))
        return ParsedToolOutput(text[:first].rstrip(), calls)
