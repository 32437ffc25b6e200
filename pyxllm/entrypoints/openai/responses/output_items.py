"""A response's output items, built from what chat completions' code makes of the generated
text (reasoning split off, tool calls found), whole or as it streams, with the stream events
that announce each change (an item added, a text delta, an item done).

One :class:`OutputBuilder` makes the items both ways, so a streamed response ends with the same
output as the same request unstreamed: a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` with the text (also when nothing else came back, then empty), a ``function_call``
per call, in the order they began.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pyxllm.entrypoints.openai.protocol import ChatCompletionLogProbsContent, ToolCall
from pyxllm.entrypoints.openai.responses.protocol import (
    ItemStatus,
    OutputItem,
    ResponseContentPartEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

Emit = Callable[[ResponseStreamEvent], None]


def new_item_id(prefix: str) -> str:
    """An output item id in OpenAI's style: ``msg_``, ``rs_`` or ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _delta_logprob(entry: ChatCompletionLogProbsContent) -> dict[str, Any]:
    """A token's logprob as a text delta event carries it (no bytes)."""
    tops = [{"token": t.token, "logprob": t.logprob} for t in entry.top_logprobs]
    return {"token": entry.token, "logprob": entry.logprob, "top_logprobs": tops}


class OutputBuilder:
    """A response's output items, fed its reasoning, text and tool calls as they come; each
    change is also announced to ``emit`` as the stream event that says it.

    Args:
        emit: receives each event (a no-op for a response that is not streamed).
    """

    def __init__(self, emit: Emit | None = None) -> None:
        self.emit: Emit = emit or (lambda event: None)
        self.items: list[OutputItem] = []
        self.open: list[int] = []  # indices of the items not closed yet
        self.reasoning_item: ResponseReasoningItem | None = None
        self.message: ResponseOutputMessage | None = None
        self.calls: dict[int, ResponseFunctionToolCall] = {}
        self.unsent_logprobs: list[ChatCompletionLogProbsContent] = []

    def _add(self, item: OutputItem) -> int:
        if self.reasoning_item is not None:  # the reasoning ends where anything else begins
            self._close(self.items.index(self.reasoning_item), "completed")
            self.reasoning_item = None
        self.items.append(item)
        index = len(self.items) - 1
        self.open.append(index)
        self.emit(
            ResponseOutputItemEvent(
                type="response.output_item.added", output_index=index, item=item
            )
        )
        return index

    def reasoning(self, delta: str) -> None:
        """Append ``delta`` to the reasoning item (opened by the first reasoning text)."""
        if not delta:
            return
        item = self.reasoning_item
        if item is None:
            item = ResponseReasoningItem(id=new_item_id("rs"))
            self._add(item)
            self.reasoning_item = item
            item.content.append(ResponseReasoningText())
            self._part_event("response.content_part.added", item)
        item.content[0].text += delta
        index = self.items.index(item)
        self.emit(ResponseReasoningTextDeltaEvent(item_id=item.id, output_index=index, delta=delta))

    def text(self, delta: str, logprobs: list[ChatCompletionLogProbsContent] | None) -> None:
        """Append ``delta`` to the message (opened by the first text); ``logprobs`` of the new
        tokens go with the next text sent."""
        self.unsent_logprobs += logprobs or ()
        if not delta:
            return
        item = self._message()
        item.content[0].text += delta
        sent, self.unsent_logprobs = self.unsent_logprobs, []
        item.content[0].logprobs += sent
        self.emit(
            ResponseTextDeltaEvent(
                item_id=item.id,
                output_index=self.items.index(item),
                delta=delta,
                logprobs=[_delta_logprob(entry) for entry in sent],
            )
        )

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        """Append ``arguments`` to tool call ``index`` (the call's item opened by its first
        delta, which brings its ``call_id`` and ``name``)."""
        item = self.calls.get(index)
        if item is None:
            item = ResponseFunctionToolCall(id=new_item_id("fc"), call_id=call_id, name=name)
            self._add(item)
            self.calls[index] = item
        if arguments:
            item.arguments += arguments
            self.emit(
                ResponseFunctionCallArgumentsDeltaEvent(
                    item_id=item.id, output_index=self.items.index(item), delta=arguments
                )
            )

    def whole(
        self,
        reasoning: str | None,
        content: str | None,
        logprobs: list[ChatCompletionLogProbsContent] | None,
        tool_calls: list[ToolCall],
    ) -> None:
        """Feed a whole reply, as chat completions' non-streamed message says it."""
        self.reasoning(reasoning or "")
        self.text(content or "", logprobs)
        for index, call in enumerate(tool_calls):
            self.call(index, call.id, call.function.name, call.function.arguments)

    def finish(self, status: ItemStatus) -> None:
        """Close the items still open with ``status`` (a message, empty, when there is no
        item at all; logprobs not sent yet go to the message)."""
        if not self.items:
            self._message()
        if self.message is not None:
            self.message.content[0].logprobs += self.unsent_logprobs
        self.unsent_logprobs = []
        for index in list(self.open):
            self._close(index, status)

    def assistant_message(self) -> dict[str, Any]:
        """The output as a chat message of the assistant (how the conversation goes on)."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.items:
            if isinstance(item, ResponseReasoningItem):
                message["reasoning_content"] = item.content[0].text
            elif isinstance(item, ResponseOutputMessage):
                message["content"] = item.content[0].text
            else:
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                message.setdefault("tool_calls", []).append(call)
        return message

    def _message(self) -> ResponseOutputMessage:
        if self.message is None:
            self.message = ResponseOutputMessage(id=new_item_id("msg"))
            self._add(self.message)
            self.message.content.append(ResponseOutputText(logprobs=[]))
            self._part_event("response.content_part.added", self.message)
        return self.message

    def _part_event(self, kind: str, item: ResponseOutputMessage | ResponseReasoningItem) -> None:
        self.emit(
            ResponseContentPartEvent(
                type=kind,
                item_id=item.id,
                output_index=self.items.index(item),
                part=item.content[0],
            )
        )

    def _close(self, index: int, status: ItemStatus) -> None:
        item = self.items[index]
        self.open.remove(index)
        item.status = status
        if isinstance(item, ResponseReasoningItem):
            done = ResponseReasoningTextDoneEvent(
                item_id=item.id, output_index=index, text=item.content[0].text
            )
            self.emit(done)
            self._part_event("response.content_part.done", item)
        elif isinstance(item, ResponseOutputMessage):
            part = item.content[0]
            logprobs = [_delta_logprob(entry) for entry in part.logprobs or ()]
            self.emit(
                ResponseTextDoneEvent(
                    item_id=item.id, output_index=index, text=part.text, logprobs=logprobs
                )
            )
            self._part_event("response.content_part.done", item)
        else:
            done = ResponseFunctionCallArgumentsDoneEvent(
                item_id=item.id, output_index=index, arguments=item.arguments
            )
            self.emit(done)
        self.emit(
            ResponseOutputItemEvent(type="response.output_item.done", output_index=index, item=item)
        )
