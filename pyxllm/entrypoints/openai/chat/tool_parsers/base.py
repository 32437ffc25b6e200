"""What every tool parser shares: the parsed state of a text, a call's JSON, and the stream.

A parser is a pure function of the text generated so far, ``parse(text, final)`` ->
:class:`ParsedToolOutput` (the content, and every call with its name and its arguments' JSON
text). Streaming calls it again after each new piece and sends what grew
(:class:`ToolCallStream`), so feeding a text whole, token by token or character by character
gives the same calls and content. For that, each field of a non-final parse is a prefix of the
same field in every later parse:

- content holds back a trailing piece that may begin a call's tag (and, before a call, trailing
  whitespace);
- a call's name appears once its JSON string is complete;
- a call's arguments are the raw JSON text the model wrote (OpenAI: "arguments" is a JSON
  string, possibly invalid, that the client validates). While the value is incomplete, its
  trailing whitespace is held back and a fragment is sent only while the text so far is a
  valid JSON prefix (``partial-json-parser``), so a malformed tail arrives in the last chunk.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field

import partial_json_parser

from pyxllm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class ToolCallState:
    """One call as parsed so far: ``name`` once known, ``arguments`` the JSON text so far."""

    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedToolOutput:
    """A text split into ``content`` and ``calls``."""

    content: str = ""
    calls: list[ToolCallState] = field(default_factory=list)


def json_value_span(text: str, start: int) -> int | None:
    """The end of the complete JSON value at ``text[start]``, ``None`` if it is incomplete or
    malformed."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def call_from_json(text: str, final: bool, name: str | None = None) -> ToolCallState:
    """The call written as a JSON object ``{"name": ..., "arguments": {...}}`` (``parameters``
    for ``arguments`` also, as Llama 3 writes it), complete or not; ``name`` given when the text
    holds the arguments alone (a named ``tool_choice``: the whole text is the arguments)."""
    call = ToolCallState(name=name)
    if name is not None:
        call.arguments = arguments_text(text, len(text) - len(text.lstrip()), final)
        return call
    match = _ARGUMENTS.search(text)
    if match is None:  # no arguments (yet): "{}" only for a whole call written without them
        call.name = _name_in(text)
        brace = text.find("{")
        whole = brace >= 0 and json_value_span(text, brace) is not None
        call.arguments = "{}" if final and whole else ""
        return call
    call.arguments = arguments_text(text, match.end(), final)
    end = json_value_span(text, match.end())
    # the call's own "name", not one inside its arguments
    call.name = _name_in(text[: match.start()]) or (None if end is None else _name_in(text[end:]))
    return call


def _name_in(text: str) -> str | None:
    match = _NAME.search(text)
    return None if match is None else json.loads(match.group(1))


def arguments_text(text: str, start: int, final: bool) -> str:
    """The arguments' JSON text beginning at ``text[start]`` (see the module docstring)."""
    end = json_value_span(text, start)
    if end is not None:
        return text[start:end]
    if final:  # cut short (max_tokens): what the model wrote, never arguments it did not
        return text[start:].rstrip()
    so_far = text[start:].rstrip()
    while so_far:
        try:
            partial_json_parser.loads(so_far)
            return so_far
        except Exception:  # noqa: BLE001 - not a valid JSON prefix (yet): hold the tail back
            so_far = so_far[:-1].rstrip()
    return ""


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def no_call_yet(text: str, tag: str, final: bool) -> ParsedToolOutput:
    """The parse of a text in which ``tag`` (what opens the calls) does not appear: all of it
    is content when ``final``; else what precedes a tail that may begin ``tag``, and trailing
    whitespace (which may come before a call), is held back."""
    if final:
        return ParsedToolOutput(text)
    return ParsedToolOutput(text[: len(text) - held_back(text, tag)].rstrip())


class ToolParser(abc.ABC):
    """Splits a chat completion's text into content and tool calls (see the module docstring).

    Args:
        tokenizer: the engine's tokenizer (parsers that look at token ids may need it).

    Attributes:
        text_is_content: whether a reply in which no call is found is content (a model that
            answered instead of calling); ``False`` for a forced call's parser, whose text is
            always the call's JSON, so a call cut before its name gives neither content nor a
            call.
        tags: the markers the parser reads in the text (``[TOOL_CALLS]`` ...).
        needs_special_tokens: True when ``tokenizer`` marks one of :attr:`tags` special, so
            that decoding with ``skip_special_tokens`` would drop it: an ``auto`` request then
            keeps special tokens in its text, unless it sets ``skip_special_tokens`` itself.
    """

    text_is_content = True
    tags: tuple[str, ...] = ()

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.needs_special_tokens = tokenizer is not None and any(
            tag
            not in tokenizer.decode(
                tokenizer.encode(tag, add_special_tokens=False), skip_special_tokens=True
            )
            for tag in self.tags
        )

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        """The content and calls of ``text``; ``final`` when the text is complete."""

    def content_without_calls(self, text: str, parsed: ParsedToolOutput) -> str:
        """The content of a final ``text`` in which no call was found (``parsed``, its parse):
        all of it when :attr:`text_is_content` (a model that answered instead of calling),
        else the parsed content. A format whose markers are never content (harmony's message
        headers) gives its parsed content."""
        return text if self.text_is_content else parsed.content

    def for_tools(self, tools: list) -> ToolParser:
        """The parser of one request that offers ``tools`` (its
        :class:`~pyxllm.entrypoints.openai.protocol.ChatCompletionToolParam` list): this one,
        unless the parser needs the tools' schemas (``qwen3_coder`` types values by them)."""
        return self


def new_call_id() -> str:
    """A tool call id in OpenAI's style (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(parsed: ParsedToolOutput, limit: int | None = None) -> list[ToolCall]:
    """The response's ``tool_calls``: every parsed call with a name (the first ``limit``)."""
    calls = [c for c in parsed.calls if c.name is not None][:limit]
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def split_tool_calls(
    parser: ToolParser, text: str, limit: int | None = None
) -> tuple[str | None, list[ToolCall]]:
    """``(content, tool_calls)`` of a whole reply: the content is ``None`` when empty, and the
    whole text when no call is found (``None`` for a forced call's parser; see
    :meth:`ToolParser.content_without_calls`)."""
    parsed = parser.parse(text, final=True)
    calls = tool_calls_of(parsed, limit)
    if not calls:
        return parser.content_without_calls(text, parsed) or None, []
    return parsed.content or None, calls


class ToolCallStream:
    """Turns the successive parses of a growing text into stream deltas.

    Args:
        parser: the parser of this request's text.
        limit: the most calls to send (1 when ``parallel_tool_calls`` is false).
    """

    def __init__(self, parser: ToolParser, limit: int | None = None) -> None:
        self.parser, self.limit = parser, limit
        self.content_sent = 0
        self.ids: list[str] = []
        self.arguments_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        """Calls whose first delta was sent."""
        return len(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """``(content delta, tool call deltas)`` now that the text is ``text``, at most one
        delta per call (clients such as instructor read one entry per index from a chunk): a
        new call's header carries the arguments parsed so far. A final text in which no call
        was found is content as the parser says (:meth:`ToolParser.content_without_calls`)."""
        parsed = self.parser.parse(text, final)
        if final and not self.ids and not any(c.name for c in parsed.calls):
            parsed = ParsedToolOutput(self.parser.content_without_calls(text, parsed))
        content = parsed.content[self.content_sent :]
        self.content_sent = len(parsed.content)
        deltas = []
        calls = [c for c in parsed.calls if c.name is not None][: self.limit]
        for index, call in enumerate(calls):
            if index == len(self.ids):  # the call's header, with the arguments so far
                self.ids.append(new_call_id())
                self.arguments_sent.append(len(call.arguments))
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=self.ids[index],
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                )
                continue
            fragment = call.arguments[self.arguments_sent[index] :]
            if fragment:
                self.arguments_sent[index] = len(call.arguments)
                deltas.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
                )
        return content, deltas
