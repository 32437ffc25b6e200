"""What a chat choice says: its message (reasoning split off), the stream's deltas, logprobs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from pyxllm.engine.input_processor import EngineRequest
from pyxllm.entrypoints.openai.chat.reasoning import ReasoningParser
from pyxllm.entrypoints.openai.chat.tool_parsers import ToolCallStream
from pyxllm.entrypoints.openai.chat.tools import ToolPlan
from pyxllm.entrypoints.openai.logprobs import chat_logprobs
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionTokenUsageInfo,
    DeltaMessage,
    UsageInfo,
)
from pyxllm.entrypoints.openai.serving_engine import ChoiceEvents, sse
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams


class ChatEvents(ChoiceEvents):
    """A chat stream's events: per choice a role delta first, then content (and reasoning)
    deltas with their logprobs, and tool call deltas when the request's tools are parsed; the
    last one with the finish reason."""

    def __init__(
        self,
        request: EngineRequest,
        created: int,
        model: str,
        reasoning: ReasoningParser | None,
        tools: ToolPlan,
        token_bytes: Callable[[int], bytes],
    ) -> None:
        self.request_id, self.created, self.model = request.request_id, created, model
        self.token_bytes = token_bytes
        self.params, self.reasoning = request.sampling_params, reasoning
        n = self.params.n
        self.texts, self.num_sent = [""] * n, [0] * n
        self.contents = [""] * n  # the content so far (the text after any reasoning)
        self.token_ids: list[Sequence[int]] = [()] * n  # each choice's tokens so far
        self.calls = [
            None if tools.parser is None else ToolCallStream(tools.parser, tools.limit)
            for _ in range(n)
        ]

    def chunk(
        self, index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None
    ) -> str:
        choice = ChatCompletionResponseStreamChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return sse(
            ChatCompletionStreamResponse(
                id=self.request_id, created=self.created, model=self.model, choices=[choice]
            )
        )

    def opening(self) -> Iterator[str]:
        for index in range(self.params.n):
            yield self.chunk(index, DeltaMessage(role="assistant", content=""))

    def advance(
        self, completion: CompletionOutput
    ) -> tuple[DeltaMessage, ChatCompletionLogProbs | None, str | None]:
        """What the choice's new state adds: ``(delta, logprobs of the new tokens, finish
        reason)``, the delta's reasoning split off and tool calls found (the finish reason is
        ``tool_calls`` when calls were sent, ``None`` until the choice finished)."""
        i, finished = completion.index, completion.finish_reason is not None
        delta = delta_message(self.texts[i], completion.text, finished, self.reasoning)
        logprobs = choice_logprobs(completion, self.params, self.token_bytes, self.num_sent[i])
        self.texts[i], self.num_sent[i] = completion.text, len(completion.token_ids)
        self.token_ids[i] = completion.token_ids
        finish_reason = completion.finish_reason
        calls = self.calls[i]
        if calls is not None:
            self.contents[i] += delta.content or ""
            content, tool_calls = calls.update(self.contents[i], finished)
            delta.content, delta.tool_calls = content or None, tool_calls or None
            if finish_reason == "stop" and calls.num_calls:
                finish_reason = "tool_calls"
        return delta, logprobs, finish_reason

    def update(self, completion: CompletionOutput, output: RequestOutput) -> str | None:
        i, finished = completion.index, completion.finish_reason is not None
        delta, logprobs, finish_reason = self.advance(completion)
        if finished:
            return self.chunk(i, delta, logprobs, finish_reason, completion.stop_reason)
        if delta.content or delta.reasoning_content or delta.tool_calls:
            return self.chunk(i, delta, logprobs)
        if logprobs and logprobs.content:
            return self.chunk(i, delta, logprobs)
        return None

    def aborted(self, index: int) -> str:
        text = self.texts[index]
        delta = delta_message(text, text, True, self.reasoning)
        return self.chunk(index, delta, finish_reason="abort")

    def usage(self, usage: UsageInfo) -> str:
        usage = with_reasoning_tokens(usage, self.reasoning, self.token_ids)
        return sse(
            ChatCompletionStreamResponse(
                id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
            )
        )

    @property
    def completion_tokens(self) -> int:
        return sum(self.num_sent)


def with_reasoning_tokens(
    usage: UsageInfo, reasoning: ReasoningParser | None, token_ids: Sequence[Sequence[int]]
) -> UsageInfo:
    """``usage`` with ``completion_tokens_details.reasoning_tokens``, the reasoning tokens of
    every choice (``token_ids``, one list per choice) when ``reasoning`` splits them off;
    ``usage`` itself otherwise."""
    if reasoning is None:
        return usage
    count = sum(reasoning.count_reasoning_tokens(ids) for ids in token_ids)
    details = CompletionTokenUsageInfo(reasoning_tokens=count)
    return usage.model_copy(update={"completion_tokens_details": details})


def choice_logprobs(
    completion: CompletionOutput,
    params: SamplingParams,
    token_bytes: Callable[[int], bytes],
    start: int = 0,
):
    """The chat ``logprobs`` of the completion's tokens from ``start`` on (``None`` when the
    request did not ask); ``token_bytes`` gives each token's ``bytes``."""
    if params.logprobs is None or completion.logprobs is None:
        return None
    return chat_logprobs(
        completion.token_ids[start:], completion.logprobs[start:], params.logprobs, token_bytes
    )


def chat_message(text: str, reasoning: ReasoningParser | None) -> ChatMessage:
    """The assistant message of a whole generated text, split by ``reasoning`` if given
    (then an empty part is ``None``)."""
    if reasoning is None:
        return ChatMessage(role="assistant", content=text)
    reasoning_text, content = reasoning.extract_reasoning(text)
    return ChatMessage(
        role="assistant",
        content=content,
        reasoning_content=reasoning_text,
        reasoning=reasoning_text,
    )


def delta_message(
    previous_text: str, current_text: str, finished: bool, reasoning: ReasoningParser | None
) -> DeltaMessage:
    """What a stream chunk adds now that the text grew from ``previous_text`` to
    ``current_text``; empty parts are left out."""
    if reasoning is None:
        return DeltaMessage(content=current_text[len(previous_text) :] or None)
    delta = reasoning.extract_reasoning_streaming(previous_text, current_text, finished)
    return DeltaMessage(
        content=delta.content or None,
        reasoning_content=delta.reasoning or None,
        reasoning=delta.reasoning or None,
    )
