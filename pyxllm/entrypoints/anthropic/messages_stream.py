"""A streamed Messages answer: chat's deltas
(:meth:`~pyxllm.entrypoints.openai.chat.choices.ChatEvents.advance`:
reasoning split off, tool calls found) as Anthropic's events.

``message_start``; per content block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, or ``input_json_delta`` with the call's input as JSON text in pieces) and
``content_block_stop``, a ``ping`` after the first block starts (as Anthropic sends one);
then ``message_delta`` (``stop_reason``, ``stop_sequence``, the final ``usage``) and
``message_stop``. An error after the stream started is an ``error`` event, which ends it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

from pyxllm.entrypoints.anthropic.errors import anthropic_error_body
from pyxllm.entrypoints.anthropic.messages_output import message_usage, stop_reason
from pyxllm.entrypoints.anthropic.protocol import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    StreamEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from pyxllm.entrypoints.openai.chat.choices import ChatEvents
from pyxllm.entrypoints.openai.chat.serving import PreparedChat
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import UsageInfo
from pyxllm.outputs import CompletionOutput, RequestOutput

# What a request the engine stopped before its end says (its outputs ended unfinished).
STOPPED = "the engine stopped the request before it finished"


def sse_event(event: StreamEvent) -> str:
    """One server-sent event of a Messages stream: its ``event:`` line names the type (the
    SDK reads events by it)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


def error_event(message: str, status_code: int) -> str:
    """The ``error`` event that ends a stream."""
    return f"event: error\ndata: {json.dumps(anthropic_error_body(message, status_code))}\n\n"


class MessagesEvents(ChatEvents):
    """The events of one streamed Messages answer (see the module docstring).

    Args:
        message_id: ``msg_`` and hex digits (also the engine's request id).
        chat: the prepared chat request that serves it.
        model: the model name the answer names.
        token_bytes: the tokenizer's bytes of a token id (for chat's logprobs, unused here).
    """

    def __init__(
        self,
        message_id: str,
        chat: PreparedChat,
        model: str,
        token_bytes: Callable[[int], bytes],
    ) -> None:
        super().__init__(
            chat.engine_request, int(time.time()), model, chat.reasoning, chat.tools, token_bytes
        )
        self.message_id = message_id
        self.prompt_tokens = len(chat.engine_request.prompt_token_ids)
        self.index = -1  # the last block started
        self.open_key: tuple[str, int] | None = None  # the open block: ("text", 0), ("tool", i)
        self.pinged = False
        self.finish: tuple[str | None, str | int | None] | None = None
        self.cached_tokens = 0

    def opening(self) -> Iterator[str]:
        usage = message_usage(self.prompt_tokens, 0, 0)
        message = Message(id=self.message_id, model=self.model, usage=usage)
        yield sse_event(MessageStartEvent(message=message))

    def _start(self, key: tuple[str, int], block: ContentBlock) -> list[str]:
        """Close the open block and start ``block`` (a ``ping`` after the first)."""
        events = self._stop()
        self.index += 1
        self.open_key = key
        events.append(sse_event(ContentBlockStartEvent(index=self.index, content_block=block)))
        if not self.pinged:
            self.pinged = True
            events.append(sse_event(PingEvent()))
        return events

    def _stop(self) -> list[str]:
        if self.open_key is None:
            return []
        self.open_key = None
        return [sse_event(ContentBlockStopEvent(index=self.index))]

    def _delta(self, key: tuple[str, int], block: ContentBlock, delta: dict[str, str]) -> list[str]:
        """``delta`` of the block ``key``, started with ``block`` unless it is the open one."""
        events = [] if self.open_key == key else self._start(key, block)
        events.append(sse_event(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return events

    def update(self, completion: CompletionOutput, output: RequestOutput) -> str | None:
        delta, _, finish_reason = self.advance(completion)
        self.cached_tokens = output.num_cached_tokens or 0
        events: list[str] = []
        if delta.reasoning_content:
            block = ThinkingBlock(thinking="")
            thinking = {"type": "thinking_delta", "thinking": delta.reasoning_content}
            events += self._delta(("thinking", 0), block, thinking)
        if delta.content:
            text = {"type": "text_delta", "text": delta.content}
            events += self._delta(("text", 0), TextBlock(text=""), text)
        for call in delta.tool_calls or ():
            key, function = ("tool", call.index), call.function
            if self.open_key != key:
                name = function.name if function is not None else None
                block = ToolUseBlock(id=call.id or "", name=name or "", input={})
                events += self._start(key, block)
            if function is not None and function.arguments:
                piece = {"type": "input_json_delta", "partial_json": function.arguments}
                events.append(sse_event(ContentBlockDeltaEvent(index=self.index, delta=piece)))
        if finish_reason is not None:
            self.finish = (finish_reason, completion.stop_reason)
        return "".join(events) or None

    def aborted(self, index: int) -> str:
        return ""  # the engine's outputs ended without a finish reason: closing says so

    def closing(self, usage: UsageInfo | None) -> Iterator[str]:
        """The open block's stop, ``message_delta`` (with the counts this stream kept: the
        ``usage`` chat's stream passes is not asked for) and ``message_stop``; an ``error``
        event instead when the engine stopped the request."""
        reason = None if self.finish is None else stop_reason(*self.finish)
        if reason is None:
            yield error_event(STOPPED, 500)
            return
        yield from self._stop()
        counts = message_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        yield sse_event(
            MessageDeltaEvent(
                delta=MessageDelta(stop_reason=reason[0], stop_sequence=reason[1]),
                usage=MessageDeltaUsage(**counts.model_dump(exclude={"service_tier"})),
            )
        )
        yield sse_event(MessageStopEvent())

    def failed(self, error: OpenAIError) -> Iterator[str]:
        yield error_event(error.message, error.status_code)
