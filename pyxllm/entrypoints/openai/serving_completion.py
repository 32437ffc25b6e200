"""``POST /v1/completions``: prompt text or token ids -> engine -> JSON or SSE chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.logprobs import completion_logprobs
from pyxllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from pyxllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    sse,
    usage_info,
)
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """Serves (legacy) text completions from one engine, streamed or not.

    ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, the prompt
    tokens' logprobs before the generated ones; the first prompt token has ``None``); with
    ``max_tokens: 0`` a choice is the prompt alone (a one-token run computes the prompt
    logprobs; its token is not returned nor counted).
    """

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Answer one completion request (raises :class:`OpenAIError` for a bad request)."""
        self.check_model(request.model)
        self.check_health()
        if request.suffix:
            raise OpenAIError("suffix: not supported", 400, "suffix")
        echo_only = bool(request.echo) and request.max_tokens == 0
        extra = {"logprobs": request.logprobs}
        if request.echo and request.logprobs is not None:
            extra["prompt_logprobs"] = request.logprobs
        params = self.sampling_params(request, 1 if echo_only else request.max_tokens, **extra)
        prompt_token_ids, prompt = self.prompt_ids(request)
        self.fit_to_context(params, len(prompt_token_ids), "prompt")
        echo = None
        if request.echo:
            text = (
                prompt
                if prompt is not None
                else self.engine.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
            )
            echo = _Echo(text, prompt_token_ids, echo_only)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self.stream(
                lambda mark_finished: self.completion_stream(
                    request_id,
                    created,
                    prompt_token_ids,
                    prompt,
                    params,
                    include_usage,
                    mark_finished,
                    echo,
                ),
                request_id,
            )
        try:
            final = await self.generate_full(
                prompt_token_ids, params, request_id, raw_request, prompt=prompt
            )
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for completion in final.outputs:
            text, logprobs = self.choice_delta(completion, final, params, echo, 0, 0)
            choices.append(
                CompletionResponseChoice(
                    index=completion.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        num_generated = 0 if echo_only else sum(len(c.token_ids) for c in final.outputs)
        response = CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(len(prompt_token_ids), num_generated),
        )
        return JSONResponse(response.model_dump(mode="json"))

    def choice_delta(
        self,
        completion: CompletionOutput,
        output: RequestOutput,
        params: SamplingParams,
        echo: _Echo | None,
        chars_sent: int,
        tokens_sent: int,
    ):
        """``(text, logprobs)`` of a choice past what was sent (``chars_sent`` characters of
        text, ``tokens_sent`` generated tokens); with ``echo``, nothing sent yet means the
        prompt comes first. ``logprobs`` is ``None`` unless the request asked for them."""
        first = chars_sent == 0 and tokens_sent == 0
        text, ids, lps = "", [], []
        if echo is not None and first:
            text, ids = echo.text, list(echo.token_ids)
            lps = list(output.prompt_logprobs or [None] * len(ids))
        if echo is None or not echo.only:
            text += completion.text[
                chars_sent - (len(echo.text) if echo is not None and not first else 0) :
            ]
            ids += completion.token_ids[tokens_sent:]
            lps += (completion.logprobs or [])[tokens_sent:]
        if params.logprobs is None:
            return text, None
        return text, completion_logprobs(
            ids, lps, params.logprobs, chars_sent, self.engine.tokenizer.decode_each
        )

    def prompt_ids(self, request: CompletionRequest) -> tuple[list[int], str | None]:
        """``(prompt token ids, prompt text or None)``: one string, or one list of token ids."""
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"prompt: only one prompt per request is supported for now, got {len(prompt)}",
                    400,
                    "prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise OpenAIError("prompt: must not be empty", 400, "prompt")
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=True)), prompt
        if not prompt:
            raise OpenAIError("prompt: must not be empty", 400, "prompt")
        vocab_size = self.engine.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                f"prompt: token id {bad[0]} is out of range [0, {vocab_size})", 400, "prompt"
            )
        return list(prompt), None

    async def completion_stream(
        self,
        request_id: str,
        created: int,
        prompt_token_ids: list[int],
        prompt: str | None,
        params: SamplingParams,
        include_usage: bool,
        mark_finished: Callable[[], None],
        echo: _Echo | None = None,
    ) -> AsyncIterator[str]:
        """SSE events: per choice index text deltas (with logprobs if asked), one
        finish_reason; then usage (if asked) and ``[DONE]``."""

        def chunk(
            index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None
        ) -> str:
            choice = CompletionResponseChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            return sse(
                CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
            )

        n = params.n
        chars, tokens, done = [0] * n, [0] * n, [False] * n
        try:
            async for output in self.engine.generate(
                prompt_token_ids, params, request_id, prompt=prompt
            ):
                for completion in output.outputs:
                    i = completion.index
                    if done[i]:
                        continue
                    text, logprobs = self.choice_delta(
                        completion, output, params, echo, chars[i], tokens[i]
                    )
                    chars[i] += len(text)
                    tokens[i] = len(completion.token_ids)
                    if completion.finish_reason is not None:
                        done[i] = True
                        yield chunk(
                            i, text, logprobs, completion.finish_reason, completion.stop_reason
                        )
                    elif text or (logprobs and logprobs.tokens):
                        yield chunk(i, text, logprobs)
                if output.finished:
                    mark_finished()
        except Exception as exc:  # noqa: BLE001 - reported in the stream, the server lives on
            yield self.stream_error(exc)
            yield SSE_DONE
            return
        for i in range(n):
            if not done[i]:  # the engine's iterator ended without a final output
                yield chunk(i, "", finish_reason="abort")
        if include_usage:
            num_generated = 0 if echo is not None and echo.only else sum(tokens)
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage_info(len(prompt_token_ids), num_generated),
                )
            )
        yield SSE_DONE


@dataclass(slots=True)
class _Echo:
    """The prompt to put before each choice: its text, its token ids, and whether it is the
    whole choice (``max_tokens: 0``)."""

    text: str
    token_ids: list[int]
    only: bool
