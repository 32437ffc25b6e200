"""DeepSeek's calls, between its own tokens: DeepSeek V3 and R1 write each call as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek V3.1 as ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>`` (the name before the separator, the JSON arguments after it: vLLM's
``deepseek_v31``); the text before ``<｜tool▁calls▁begin｜>`` is the content.
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

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(ToolParser):
    """``--tool-call-parser deepseek_v3`` (and ``deepseek_v31``)."""

    tags = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            return no_call_yet(text, CALLS_BEGIN, final)
        parsed = ParsedToolOutput(text[:first].rstrip())
        start = text.find(CALL_BEGIN, first)
        while start >= 0:
            body = start + len(CALL_BEGIN)
            end = text.find(CALL_END, body)
            closed = end >= 0
            if not closed:
                end = len(text) - (0 if final else held_back(text, CALL_END))
            call = _call(text[body:end], final or closed)
            if call is None:
                break
            parsed.calls.append(call)
            start = text.find(CALL_BEGIN, end) if closed else -1
        return parsed


def _call(block: str, complete: bool) -> ToolCallState | None:
    """One call's ``type<｜tool▁sep｜>name\\n```json\\n{...}\\n```" (V3) or
    ``name<｜tool▁sep｜>{...}`` (V3.1); ``None`` until its name is whole."""
    sep = block.find(SEP)
    if sep < 0:
        return None
    before, after = block[:sep].strip(), sep + len(SEP)
    if before != "function":  # V3.1: the name, then the arguments
        start = after + len(block[after:]) - len(block[after:].lstrip())
        return ToolCallState(name=before, arguments=arguments_text(block, start, complete))
    newline = block.find("\n", after)
    if newline < 0:  # the name is still being written (or cut short)
        if not complete or not block[after:].strip():
            return None
        return ToolCallState(name=block[after:].strip())
    call = ToolCallState(name=block[after:newline].strip())
    fence = block.find(FENCE, newline)
    if fence < 0:  # the fence may be still coming
        if complete:
            call.arguments = arguments_text(block, newline + 1, complete)
        return call
    start = fence + len(FENCE)
    if block.startswith("json", start):
        start += len("json")
    start += len(block[start:]) - len(block[start:].lstrip())
    call.arguments = arguments_text(block, start, complete)
    return call
