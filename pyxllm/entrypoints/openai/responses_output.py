"""What a response says: its output items, built from what chat completions' code makes of the
generated text (reasoning split off, tool calls found), whole or as it streams, and the stream's
events (``response.created`` ... ``response.completed``).

One :class:`OutputBuilder` makes the items both ways, so a streamed response ends with the same
output as the same request unstreamed: a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` with the text (also when nothing else came back, then empty), a ``function_call``
per call, in the order they began.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from pyxllm.entrypoints.openai.chat_choices import ChatEvents
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import ChatCompletionLogProbsContent, ToolCall, UsageInfo
from pyxllm.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputTokensDetails,
    ResponseContentPartEvent,
    ResponseError,
    ResponseErrorEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseLifecycleEvent,
    ResponseOutputItemEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponsesResponse,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from pyxllm.entrypoints.openai.reasoning import ReasoningParser
from pyxllm.entrypoints.openai.serving_engine import usage_info
from pyxllm.outputs import CompletionOutput

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


def reasoning_tokens(token_ids: list[int], reasoning: ReasoningParser | None, text: str) -> int:
    """The output tokens up to the end of the reasoning, its closing tag included (all of them
    while it never closed; 0 without reasoning ``text``)."""
    if reasoning is None or not text:
        return 0
    end = list(reasoning.end_token_ids())
    for start in range(len(token_ids) - len(end) + 1) if end else ():
        if token_ids[start : start + len(end)] == end:
            return start + len(end)
    return len(token_ids)


class ResponseRun:
    """One response in the making: the request fields it echoes, its engine request and its
    output (see :class:`OutputBuilder`).

    Args:
        response_id: ``resp_`` and hex digits (also the engine's request id).
        echo: the :class:`ResponsesResponse` fields that repeat the request.
        prompt_tokens: the prompt's length in tokens.
        reasoning: the parser splitting off this request's reasoning, if any.
        emit: receives the stream's events (``None``: not streamed).
    """

    def __init__(
        self,
        response_id: str,
        echo: dict[str, Any],
        prompt_tokens: int,
        reasoning: ReasoningParser | None,
        emit: Emit | None = None,
    ) -> None:
        self.id, self.echo, self.created_at = response_id, echo, int(time.time())
        self.prompt_tokens, self.reasoning = prompt_tokens, reasoning
        self.output = OutputBuilder(emit)

    def response(self, status: str, **fields) -> ResponsesResponse:
        """The response object as it stands, with ``status`` and ``fields``."""
        return ResponsesResponse(
            id=self.id,
            created_at=self.created_at,
            status=status,
            output=list(self.output.items),
            **self.echo,
            **fields,
        )

    def finish(self, completion: CompletionOutput | None, finish_reason: str | None):
        """Close the output and return the final response: ``completed``, ``incomplete``
        (``max_output_tokens`` reached) or ``failed`` (the engine stopped the request)."""
        status = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}.get(
            finish_reason or "", "failed"
        )
        self.output.finish("completed" if status == "completed" else "incomplete")
        token_ids = list(completion.token_ids) if completion is not None else []
        reasoning_text = "".join(
            item.content[0].text
            for item in self.output.items
            if isinstance(item, ResponseReasoningItem)
        )
        fields: dict[str, Any] = {
            "usage": response_usage(
                usage_info(self.prompt_tokens, len(token_ids)),
                reasoning_tokens(token_ids, self.reasoning, reasoning_text),
            )
        }
        if status == "completed":
            fields["completed_at"] = int(time.time())
        elif status == "incomplete":
            fields["incomplete_details"] = IncompleteDetails(reason="max_output_tokens")
        else:
            fields["error"] = ResponseError(
                code="server_error", message="the engine stopped the request before it finished"
            )
        return self.response(status, **fields)


def response_usage(usage: UsageInfo, reasoning: int) -> ResponseUsage:
    """The Responses ``usage`` of chat's ``usage``, ``reasoning`` of its output tokens being
    reasoning."""
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=0),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
        total_tokens=usage.total_tokens,
    )


def sse_event(event: ResponseStreamEvent) -> str:
    """One server-sent event of a Responses stream: its ``event:`` line names the type."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class ResponsesEvents(ChatEvents):
    """A Responses stream: chat's deltas (reasoning split off, tool calls found; see
    :meth:`ChatEvents.advance`) turned into Responses events, numbered from 0.

    ``on_done`` gets the final response (completed, incomplete or failed) before its event is
    sent; no ``[DONE]`` follows, as with OpenAI.
    """

    def __init__(self, run: ResponseRun, chat, model: str, on_done) -> None:
        super().__init__(chat.engine_request, run.created_at, model, chat.reasoning, chat.tools)
        self.run, self.on_done = run, on_done
        self.buffer: list[str] = []
        self.sequence_number = 0
        run.output.emit = self.emit
        self.completion: CompletionOutput | None = None
        self.finish_reason: str | None = None

    def emit(self, event: ResponseStreamEvent) -> None:
        """Number ``event`` and serialize it now (the objects it shows change later)."""
        event.sequence_number = self.sequence_number
        self.sequence_number += 1
        self.buffer.append(sse_event(event))

    def flush(self) -> str:
        """The events emitted since the last flush."""
        text, self.buffer = "".join(self.buffer), []
        return text

    def opening(self) -> Iterator[str]:
        for kind in ("response.created", "response.in_progress"):
            self.emit(ResponseLifecycleEvent(type=kind, response=self.run.response("in_progress")))
        yield self.flush()

    def update(self, completion, output) -> str | None:
        delta, logprobs, finish_reason = self.advance(completion)
        self.completion, self.finish_reason = completion, finish_reason
        out = self.run.output
        out.reasoning(delta.reasoning_content or "")
        out.text(delta.content or "", logprobs.content if logprobs else None)
        for call in delta.tool_calls or ():
            function = call.function
            out.call(call.index, call.id, function.name, function.arguments or "")
        return self.flush() or None

    def aborted(self, index: int) -> str:
        return ""  # the engine's outputs ended without a finish reason: closing says failed

    def closing(self, usage: UsageInfo | None) -> Iterator[str]:
        response = self.run.finish(self.completion, self.finish_reason)
        self.on_done(response)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        self.emit(
            ResponseLifecycleEvent(
                type=kind.get(response.status, "response.failed"), response=response
            )
        )
        yield self.flush()

    def failed(self, error: OpenAIError) -> Iterator[str]:
        self.emit(
            ResponseErrorEvent(
                code=str(error.status_code), message=error.message, param=error.param
            )
        )
        response = self.run.response(
            "failed", error=ResponseError(code="server_error", message=error.message)
        )
        self.emit(ResponseLifecycleEvent(type="response.failed", response=response))
        yield self.flush()
