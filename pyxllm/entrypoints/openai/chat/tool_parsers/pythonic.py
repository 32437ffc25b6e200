"""Pythonic calls, as Llama 3.2 and Llama 4 write them with vLLM's pythonic chat templates (and
Gemma 3, ToolACE): the reply is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", unit="celsius"), ping()]`` (Llama 4 between ``<|python_start|>``
and ``<|python_end|>``); a reply that does not start with ``[`` is content.

Each argument's value is read with :func:`ast.literal_eval` (literals only: strings, numbers,
``True``/``False``/``None``, lists, tuples and dicts of them; nothing is evaluated) and written
as JSON. A call's arguments grow one complete keyword argument at a time (``{"city": "Paris"``,
then ``, "unit": "celsius"``, then ``}`` at the call's ``)``), so every streamed fragment is a
prefix of the final arguments. An argument that is not ``name=literal`` stops its call's
arguments there: the client gets JSON that does not parse, as with a malformed JSON call.
"""

from __future__ import annotations

import ast
import json
import re

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolCallState,
    ToolParser,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\(")
_OPEN, _CLOSE = "([{", ")]}"


class PythonicToolParser(ToolParser):
    """``--tool-call-parser pythonic`` (and ``llama4_pythonic``)."""

    tags = (PYTHON_START,)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        body = text.lstrip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START) :].lstrip()
        if not final and PYTHON_START.startswith(body):  # "" or what may begin the tag
            return ParsedToolOutput("")
        if not body.startswith("["):
            return ParsedToolOutput(text)
        return ParsedToolOutput("", list(_calls(body, 1, final)))


def _calls(text: str, pos: int, final: bool):
    """The calls of the list whose items begin at ``text[pos]``, the last maybe unfinished."""
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        match = _NAME.match(text, pos)
        if match is None:  # "]", text after the list, or a name still being written
            return
        pieces, start, closed = [], match.end(), False
        for end, stop in _arguments(text, start):
            argument = text[start:end]
            if stop is None and not final:  # the last argument is unfinished
                break
            if not (stop == ")" and not argument.strip()):  # "f()" or "f(a=1, )"
                piece = _keyword_json(argument) if stop != "!" else None
                if piece is None:  # not name=literal (or cut short): the call stops here
                    break
                pieces.append(piece)
            start, closed = end + 1, stop == ")"
        arguments = "{" + ", ".join(pieces) + ("}" if closed else "")
        yield ToolCallState(name=match.group(1), arguments=arguments)
        if not closed:
            return
        pos = start


def _arguments(text: str, start: int):
    """``(end, stop)`` of each argument from ``text[start]``: ``stop`` is the top-level ``,``
    or ``)`` at ``text[end]`` that ends it, ``"!"`` a stray closing bracket there, ``None``
    for the unfinished last one (``end`` the text's length)."""
    depth, quote, pos = 0, "", start
    while pos < len(text):
        char = text[pos]
        if quote:
            if char == "\\":
                pos += 1
            elif text.startswith(quote, pos):
                pos += len(quote) - 1
                quote = ""
        elif char in "'\"":
            quote = char * 3 if text.startswith(char * 3, pos) else char
            pos += len(quote) - 1
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            if depth == 0:
                yield pos, (")" if char == ")" else "!")
                return
            depth -= 1
        elif char == "," and depth == 0:
            yield pos, ","
        pos += 1
    yield len(text), None


def _keyword_json(argument: str) -> str | None:
    """``"name": value`` as JSON for one ``name=literal`` argument, ``None`` for another."""
    try:
        call = ast.parse(f"f({argument.strip()})", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1:
        return None
    keyword = call.keywords[0]
    if keyword.arg is None:  # **kwargs
        return None
    try:
        value = json.dumps(ast.literal_eval(keyword.value), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return f"{json.dumps(keyword.arg, ensure_ascii=False)}: {value}"
