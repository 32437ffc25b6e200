"""Qwen3-Coder's XML calls: each call is

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

and the text before the first ``<tool_call>`` is the content. A parameter's value is the text
between its tags (less the newline after the opening tag and the one before the closing tag),
typed by the tool's JSON schema (:func:`typed_value`): a string stays a string, a number,
boolean, null, object or array is parsed, and a value that does not parse as its type is kept
as a string. A call's arguments grow one complete parameter at a time and close at
``</function>``, so every streamed fragment is a prefix of the final arguments.
"""

from __future__ import annotations

import ast
import copy
import json
from typing import Any

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolCallState,
    ToolParser,
    no_call_yet,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    """``--tool-call-parser qwen3_coder``.

    Attributes:
        properties: each function's parameters' JSON schemas (``properties``), by name; set
            per request by :meth:`for_tools`.
    """

    tags = (START, END)

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.properties: dict[str, dict] = {}

    def for_tools(self, tools) -> Qwen3CoderToolParser:
        """A copy that types values by ``tools``' parameters."""
        parser = copy.copy(self)
        parser.properties = {}
        for tool in tools:
            schema = tool.function.parameters or {}
            found = schema.get("properties") if isinstance(schema, dict) else None
            parser.properties[tool.function.name] = found if isinstance(found, dict) else {}
        return parser

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(START)
        if first < 0:
            return no_call_yet(text, START, final)
        parsed = ParsedToolOutput(text[:first].rstrip())
        start = first
        while start >= 0:
            body = start + len(START)
            end = text.find(END, body)
            closed = end >= 0
            call = self._call(text[body:] if not closed else text[body:end], final or closed)
            if call is not None:
                parsed.calls.append(call)
            start = text.find(START, end + len(END)) if closed else -1
        return parsed

    def _call(self, block: str, complete: bool) -> ToolCallState | None:
        """The call in one ``<tool_call>`` block; ``None`` until its name is whole."""
        at = block.find(FUNCTION)
        name_end = -1 if at < 0 else block.find(">", at)
        if name_end < 0:
            return None
        name = block[at + len(FUNCTION) : name_end].strip()
        properties = self.properties.get(name, {})
        pieces, pos = [], name_end + 1
        function_end = block.find(FUNCTION_END, pos)
        closed = function_end >= 0 or complete
        limit = function_end if function_end >= 0 else len(block)
        while True:
            at = block.find(PARAMETER, pos, limit)
            key_end = -1 if at < 0 else block.find(">", at, limit)
            if key_end < 0:
                break
            key = block[at + len(PARAMETER) : key_end].strip()
            value_end = _value_end(block, key_end + 1, limit, function_end >= 0)
            if value_end is None:  # the value is still being written
                closed = False
                break
            value = block[key_end + 1 : value_end].removeprefix("\n").removesuffix("\n")
            piece = json.dumps(typed_value(value, properties.get(key)), ensure_ascii=False)
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {piece}")
            pos = value_end
        if function_end < 0 and not complete:
            closed = False
        return ToolCallState(name=name, arguments="{" + ", ".join(pieces) + ("}" if closed else ""))


def _value_end(block: str, start: int, limit: int, function_closed: bool) -> int | None:
    """Where the value from ``block[start]`` ends: at ``</parameter>``, or (a model that left
    the tag out) at the next ``<parameter=`` or at ``</function>``; ``None`` before that."""
    end = block.find(PARAMETER_END, start, limit)
    if end >= 0:
        return end
    following = block.find(PARAMETER, start, limit)
    if following >= 0:
        return following
    return limit if function_closed else None


def typed_value(value: str, schema: Any) -> Any:
    """A parameter's text as the type its JSON ``schema`` gives (``type``, one or a list):
    ``value`` itself for a string, an unknown parameter or text that does not parse."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if not types and isinstance(schema, dict) and ("properties" in schema or "items" in schema):
        types = ["object" if "properties" in schema else "array"]
    stripped = value.strip()
    for kind in types:
        if kind == "string":
            continue
        if kind == "null" and stripped in ("null", "None"):
            return None
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind in ("integer", "number"):
            try:
                number = json.loads(stripped)
            except ValueError:
                continue
            if isinstance(number, int | float) and not isinstance(number, bool):
                if kind == "number" or isinstance(number, int) or number.is_integer():
                    return int(number) if kind == "integer" else number
        if kind in ("object", "array"):
            parsed = _structured(stripped)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value


def _structured(text: str) -> Any:
    """``text`` as JSON, else as a Python literal (models write ``{'a': 1}`` too); ``None``."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
