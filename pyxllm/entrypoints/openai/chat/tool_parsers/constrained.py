"""The calls of a constrained reply: ``tool_choice: "required"`` makes the model write a JSON
array of ``{"name", "arguments"}`` objects, a named ``tool_choice`` the arguments object alone
(see :mod:`pyxllm.entrypoints.openai.chat.tools`); the reply has no content."""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolParser,
    call_from_json,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json import json_sequence


class RequiredCallsParser(ToolParser):
    """A JSON array of calls."""

    text_is_content = False

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = text.find("[")
        calls = [] if start < 0 else json_sequence(text, final, separators=",", start=start + 1)
        return ParsedToolOutput("", calls)


class NamedCallParser(ToolParser):
    """The arguments of the one function ``name``."""

    text_is_content = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        return ParsedToolOutput("", [call_from_json(text, final, name=self.name)])
