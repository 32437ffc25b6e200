"""OpenAI's harmony format, as gpt-oss writes its replies: the text split into messages.

A reply is a sequence of messages, each a header, ``<|message|>``, and a body that
``<|end|>``, ``<|call|>`` or ``<|return|>`` closes::

    <|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.

The first message has no ``<|start|>assistant`` (the prompt ends with it). The header names
the channel (``analysis``: the reasoning; ``final``: the answer; ``commentary``: tool calls
and the preambles shown before them) and may name a recipient, ``to=functions.NAME`` for a
call of the function NAME, before or after ``<|channel|>`` (gpt-oss's chat template writes
``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``, the model
often ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``). The body of a
call is its arguments' JSON. Text outside any header (a model that wrote no harmony, or a
request that dropped the special tokens) is a message with no channel.

The special tokens are matched on text, so a request's text must keep them
(``skip_special_tokens=False``). :func:`parse_messages` is a pure function of the text so far
and, unless ``final``, holds back a trailing piece that may begin a special token and shows a
message only once its header is complete: each message's body, as the text grows, only grows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN = "<|call|>", "<|return|>"
# The tokens that close a body, and those that open a header (a body stops before them).
CLOSERS = (END, CALL, RETURN)
OPENERS = (START, CHANNEL)
FUNCTIONS = "functions."

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    """One message of a harmony text, by its offsets in that text.

    Attributes:
        channel: ``"analysis"``, ``"commentary"``, ``"final"`` ...; ``None`` for text outside
            any header.
        recipient: what the header sends the message to (``"functions.get_weather"``), or
            ``None``.
        start: where the message begins (its ``<|start|>`` or ``<|channel|>``).
        body_start: where its body begins, after ``<|message|>``.
        body_end: where its body ends (before its closing token, or a held-back tail).
        end: after its closing token; ``body_end`` while the message is open.
        closed: a closing token (or the next message's header) ended the body.
    """

    channel: str | None
    recipient: str | None
    start: int
    body_start: int
    body_end: int
    end: int
    closed: bool

    @property
    def function_name(self) -> str | None:
        """The function a call message calls (its recipient less ``functions.``), else
        ``None``."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]


def _held(text: str, start: int) -> int:
    """How many trailing characters of ``text`` (none before ``start``) may begin a special
    token that ends a body."""
    longest = max(len(tag) for tag in CLOSERS + OPENERS)
    for n in range(min(longest - 1, len(text) - start), 0, -1):
        tail = text[-n:]
        if any(tag.startswith(tail) for tag in CLOSERS + OPENERS):
            return n
    return 0


def _body_end(text: str, start: int, final: bool) -> tuple[int, int, bool]:
    """``(body_end, end, closed)`` of the body beginning at ``text[start]``."""
    ends = [(i, i + len(tag)) for tag in CLOSERS if (i := text.find(tag, start)) >= 0]
    ends += [(i, i) for tag in OPENERS if (i := text.find(tag, start)) >= 0]
    if ends:
        body_end, end = min(ends)
        return body_end, end, True
    body_end = len(text) - (0 if final else _held(text, start))
    return body_end, body_end, False


def _opens_header(text: str, pos: int, final: bool) -> bool:
    if text.startswith(OPENERS, pos):
        return True
    return not final and any(tag.startswith(text[pos:]) for tag in OPENERS)


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of ``text`` (see the module docstring); ``final`` when no more text
    follows: nothing is held back, and a header cut short (``max_tokens``) is dropped."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        channel = recipient = None
        body_start = pos
        if _opens_header(text, pos, final):
            marker = text.find(MESSAGE, pos)
            if marker < 0:
                break  # the header is not complete (yet)
            header = text[pos:marker]
            found = _CHANNEL.search(header)
            channel = found.group(1) if found else None
            found = _RECIPIENT.search(header)
            recipient = found.group(1) if found else None
            body_start = marker + len(MESSAGE)
        body_end, end, closed = _body_end(text, body_start, final)
        messages.append(HarmonyMessage(channel, recipient, pos, body_start, body_end, end, closed))
        if not closed:
            break
        pos = end
    return messages


def shown_text(text: str, message: HarmonyMessage) -> str:
    """A message as written, header and closing token included (as much as is shown)."""
    return text[message.start : message.end if message.closed else message.body_end]
