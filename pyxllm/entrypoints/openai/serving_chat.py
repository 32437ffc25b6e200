"""``POST /v1/chat/completions``: chat template -> engine -> JSON or SSE chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.logprobs import chat_logprobs
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from pyxllm.entrypoints.openai.reasoning import ReasoningParser, get_reasoning_parser
from pyxllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    sse,
    usage_info,
)
from pyxllm.outputs import CompletionOutput
from pyxllm.sampling_params import MAX_LOGPROBS, SamplingParams


class OpenAIServingChat(OpenAIServing):
    """Serves chat completions from one engine, streamed or not.

    With ``reasoning_parser`` (a registered name, e.g. ``"qwen3"``) the generated text is split
    into ``reasoning_content`` (also sent as ``reasoning``) and ``content``, unless the prompt
    already closed the reasoning (then all of it is content).

    Raises:
        ValueError: an unknown ``reasoning_parser``.
    """

    def __init__(self, engine, reasoning_parser: str | None = None):
        super().__init__(engine)
        self.reasoning_parser: ReasoningParser | None = None
        if reasoning_parser:
            self.reasoning_parser = get_reasoning_parser(reasoning_parser)(engine.tokenizer)

    def request_reasoning_parser(
        self, request: ChatCompletionRequest, params: SamplingParams, prompt_token_ids: list[int]
    ) -> ReasoningParser | None:
        """The parser splitting this request's text, ``None`` when nothing is to be split; keeps
        special tokens in the text when the parser's tags are special (and the request did not
        say otherwise)."""
        parser = self.reasoning_parser
        if parser is None or parser.is_reasoning_end(prompt_token_ids):
            return None
        if parser.needs_special_tokens and request.skip_special_tokens is None:
            params.skip_special_tokens = False
        return parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Answer one chat request (raises :class:`OpenAIError` for a bad request)."""
        self.check_model(request.model)
        self.check_health()
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        elif max_tokens < 1:
            raise OpenAIError(
                f"max_completion_tokens: must be >= 1, got {max_tokens}",
                400,
                "max_completion_tokens",
            )
        params = self.sampling_params(request, max_tokens, logprobs=requested_logprobs(request))
        prompt_token_ids = self.render(request)
        self.fit_to_context(params, len(prompt_token_ids), "messages")
        reasoning = self.request_reasoning_parser(request, params, prompt_token_ids)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self.stream(
                lambda mark_finished: self.chat_stream(
                    request_id,
                    created,
                    prompt_token_ids,
                    params,
                    include_usage,
                    mark_finished,
                    reasoning,
                ),
                request_id,
            )
        try:
            final = await self.generate_full(prompt_token_ids, params, request_id, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=chat_message(c.text, reasoning),
                    logprobs=choice_logprobs(c, params),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in final.outputs
            ],
            usage=usage_info(len(prompt_token_ids), sum(len(c.token_ids) for c in final.outputs)),
        )
        return JSONResponse(response.model_dump(mode="json"))

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """Prompt token ids: the messages through the model's chat template."""
        if not request.messages:
            raise OpenAIError("messages: must contain at least one message", 400, "messages")
        messages = []
        for i, message in enumerate(request.messages):
            entry = message.model_dump(exclude_none=True)
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(
                            f"messages[{i}].content: only text parts are supported, "
                            f"got a part of type {part.type!r}",
                            400,
                            "messages",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            entry["content"] = content
            messages.append(entry)
        kwargs = dict(request.chat_template_kwargs or {})
        kwargs.setdefault("add_generation_prompt", request.add_generation_prompt)
        try:
            ids = list(self.engine.tokenizer.apply_chat_template(messages, **kwargs))
        except (ValueError, TypeError) as exc:
            raise OpenAIError(str(exc), 400, "messages") from exc
        if not ids:
            raise OpenAIError(
                "messages: the chat template rendered an empty prompt", 400, "messages"
            )
        return ids

    async def chat_stream(
        self,
        request_id: str,
        created: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        include_usage: bool,
        mark_finished: Callable[[], None],
        reasoning: ReasoningParser | None = None,
    ) -> AsyncIterator[str]:
        """SSE events: per choice index a role delta, content (and reasoning) deltas with their
        logprobs, one finish_reason; then usage (if asked) and ``[DONE]``."""

        def chunk(
            index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None
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
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
            )

        n = params.n
        for index in range(n):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        texts, num_sent, done = [""] * n, [0] * n, [False] * n
        try:
            async for output in self.engine.generate(prompt_token_ids, params, request_id):
                for completion in output.outputs:
                    i = completion.index
                    if done[i]:
                        continue
                    finished = completion.finish_reason is not None
                    delta = delta_message(texts[i], completion.text, finished, reasoning)
                    logprobs = choice_logprobs(completion, params, num_sent[i])
                    texts[i], num_sent[i] = completion.text, len(completion.token_ids)
                    if finished:
                        done[i] = True
                        yield chunk(
                            i, delta, logprobs, completion.finish_reason, completion.stop_reason
                        )
                    elif (
                        delta.content or delta.reasoning_content or (logprobs and logprobs.content)
                    ):
                        yield chunk(i, delta, logprobs)
                if output.finished:
                    mark_finished()
        except Exception as exc:  # noqa: BLE001 - reported in the stream, the server lives on
            yield self.stream_error(exc)
            yield SSE_DONE
            return
        for i in range(n):
            if not done[i]:  # the engine's iterator ended without a final output
                yield chunk(
                    i, delta_message(texts[i], texts[i], True, reasoning), finish_reason="abort"
                )
        if include_usage:
            yield sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage_info(len(prompt_token_ids), sum(num_sent)),
                )
            )
        yield SSE_DONE


def requested_logprobs(request: ChatCompletionRequest) -> int | None:
    """The number of top logprobs per token the request asks for, ``None`` without ``logprobs``.

    Raises:
        OpenAIError: ``top_logprobs`` out of [0, 20], or above 0 without ``logprobs: true``.
    """
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIError(
            f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}", 400, "top_logprobs"
        )
    if top and not request.logprobs:
        raise OpenAIError("top_logprobs: requires logprobs to be true", 400, "top_logprobs")
    return (top or 0) if request.logprobs else None


def choice_logprobs(completion: CompletionOutput, params: SamplingParams, start: int = 0):
    """The chat ``logprobs`` of the completion's tokens from ``start`` on (``None`` when the
    request did not ask)."""
    if params.logprobs is None or completion.logprobs is None:
        return None
    return chat_logprobs(completion.token_ids[start:], completion.logprobs[start:], params.logprobs)


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
