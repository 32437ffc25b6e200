"""gpt-oss's calls in OpenAI's harmony format (``openai``, vLLM's name): a message on the
``commentary`` channel sent ``to=functions.NAME``, its body the arguments' JSON::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

The content is the body of every ``final`` message, of a ``commentary`` message with no
recipient (a preamble) and of text outside any header; ``analysis`` messages (the reasoning,
which ``--reasoning-parser openai_gptoss`` splits off first) and message headers are never
content, with or without calls. See :mod:`pyxllm.entrypoints.openai.chat.harmony`.
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.harmony import CALL, CHANNEL, MESSAGE, parse_messages
from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolParser,
    call_from_json,
)


class OpenAIToolParser(ToolParser):
    """``--tool-call-parser openai``: calls in harmony messages sent to ``functions.NAME``
    (a message sent to another recipient, a built-in tool's, is neither call nor content)."""

    tags = (CHANNEL, MESSAGE, CALL)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        parsed = ParsedToolOutput()
        content = []
        for message in parse_messages(text, final):
            body = text[message.body_start : message.body_end]
            name = message.function_name
            if name is not None:
                parsed.calls.append(call_from_json(body, final or message.closed, name=name))
            elif message.recipient is None and message.channel != "analysis":
                content.append(body)
        parsed.content = "".join(content)
        return parsed

    def content_without_calls(self, text: str, parsed: ParsedToolOutput) -> str:
        """The parsed content: harmony's headers and analysis are never content."""
        return parsed.content
