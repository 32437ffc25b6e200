"""A response in the making, whole or streamed: the fields it echoes, its output
(:class:`~.output_items.OutputBuilder`), its status and usage once the engine is done, and
the Responses stream's events (``response.created`` ... ``response.completed``) made from chat's
deltas (:class:`~..chat.choices.ChatEvents`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pyxllm.entrypoints.openai.chat.choices import ChatEvents
from pyxllm.entrypoints.openai.chat.reasoning import ReasoningParser
from pyxllm.entrypoints.openai.chat.serving import PreparedChat
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import UsageInfo
from pyxllm.entrypoints.openai.responses.output_items import OutputBuilder
from pyxllm.entrypoints.openai.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseErrorEvent,
    ResponseLifecycleEvent,
    ResponsesResponse,
    ResponseStreamEvent,
    ResponseUsage,
)
from pyxllm.entrypoints.openai.serving_engine import usage_info
from pyxllm.outputs import CompletionOutput, RequestOutput


class ResponseRun:
    """One response in the making: the request fields it echoes, its engine request and its
    output (see :class:`OutputBuilder`).

    Args:
        response_id: ``resp_`` and hex digits (also the engine's request id).
        echo: the :class:`ResponsesResponse` fields that repeat the request.
        prompt_tokens: the prompt's length in tokens.
        reasoning: the parser splitting off this request's reasoning, if any.

    A stream's :class:`ResponsesEvents` receives the output's events.
    """

    def __init__(
        self,
        response_id: str,
        echo: dict[str, Any],
        prompt_tokens: int,
        reasoning: ReasoningParser | None,
    ) -> None:
        self.id, self.echo, self.created_at = response_id, echo, int(time.time())
        self.prompt_tokens, self.reasoning = prompt_tokens, reasoning
        self.output = OutputBuilder()

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

    def finish(
        self, completion: CompletionOutput | None, finish_reason: str | None, cached_tokens: int
    ) -> ResponsesResponse:
        """Close the output and return the final response: ``completed``, ``incomplete``
        (``max_output_tokens`` reached) or ``failed`` (the engine stopped the request);
        ``cached_tokens``: the prompt tokens served from the prefix cache."""
        status = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}.get(
            finish_reason or "", "failed"
        )
        self.output.finish("completed" if status == "completed" else "incomplete")
        token_ids = list(completion.token_ids) if completion is not None else []
        reasoning = self.reasoning
        fields: dict[str, Any] = {
            "usage": response_usage(
                usage_info(self.prompt_tokens, len(token_ids), cached_tokens),
                0 if reasoning is None else reasoning.count_reasoning_tokens(token_ids),
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
    """The Responses ``usage`` of chat's ``usage`` (with its ``prompt_tokens_details``),
    ``reasoning`` of its output tokens being reasoning. ``cache_write_tokens`` is 0: the prefix
    cache fills as a side effect, no request pays to write it."""
    details = usage.prompt_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cache_write_tokens=0, cached_tokens=details.cached_tokens if details else 0
        ),
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

    def __init__(
        self,
        run: ResponseRun,
        chat: PreparedChat,
        model: str,
        on_done: Callable[[ResponsesResponse], None],
        token_bytes: Callable[[int], bytes],
    ) -> None:
        super().__init__(
            chat.engine_request, run.created_at, model, chat.reasoning, chat.tools, token_bytes
        )
        self.run, self.on_done = run, on_done
        self.buffer: list[str] = []
        self.sequence_number = 0
        run.output.emit = self.emit
        self.completion: CompletionOutput | None = None
        self.finish_reason: str | None = None
        self.cached_tokens = 0

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

    def update(self, completion: CompletionOutput, output: RequestOutput) -> str | None:
        delta, logprobs, finish_reason = self.advance(completion)
        self.completion, self.finish_reason = completion, finish_reason
        self.cached_tokens = output.num_cached_tokens or 0
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
        response = self.run.finish(self.completion, self.finish_reason, self.cached_tokens)
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
