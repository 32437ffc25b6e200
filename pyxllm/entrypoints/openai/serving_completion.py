"""``POST /v1/completions``: prompt text or token ids -> engine -> JSON or SSE chunks."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.entrypoints.openai.errors import OpenAIError
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
from pyxllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """Serves (legacy) text completions from one engine, streamed or not."""

    async def create_completion(self, request: CompletionRequest,
                                raw_request: Request) -> Response:
        """Answer one completion request (raises :class:`OpenAIError` for a bad request)."""
        self.check_model(request.model)
        self.check_health()
        if request.echo:
            raise OpenAIError("echo: not supported yet", 400, "echo")
        if request.logprobs is not None:
            raise OpenAIError("logprobs: not supported yet", 400, "logprobs")
        if request.suffix:
            raise OpenAIError("suffix: not supported", 400, "suffix")
        params = self.sampling_params(request, request.max_tokens)
        prompt_token_ids, prompt = self.prompt_ids(request)
        self.fit_to_context(params, len(prompt_token_ids), "prompt")

        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self.stream(
                lambda mark_finished: self.completion_stream(
                    request_id, created, prompt_token_ids, prompt, params, include_usage,
                    mark_finished,
                ),
                request_id,
            )
        try:
            final = await self.generate_full(prompt_token_ids, params, request_id, raw_request,
                                             prompt=prompt)
        except ClientDisconnected:
            return Response(status_code=499)
        completion = final.outputs[0]
        response = CompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[CompletionResponseChoice(
                index=0, text=completion.text, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )],
            usage=usage_info(len(prompt_token_ids), len(completion.token_ids)),
        )
        return JSONResponse(response.model_dump(mode="json"))

    def prompt_ids(self, request: CompletionRequest) -> tuple[list[int], str | None]:
        """``(prompt token ids, prompt text or None)``: one string, or one list of token ids."""
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"prompt: only one prompt per request is supported for now, got {len(prompt)}",
                    400, "prompt",
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
            raise OpenAIError(f"prompt: token id {bad[0]} is out of range [0, {vocab_size})",
                              400, "prompt")
        return list(prompt), None

    async def completion_stream(self, request_id: str, created: int,
                                prompt_token_ids: list[int], prompt: str | None,
                                params: SamplingParams, include_usage: bool,
                                mark_finished: Callable[[], None]) -> AsyncIterator[str]:
        """SSE events: text deltas, one finish_reason, usage (if asked), ``[DONE]``."""

        def chunk(text: str, finish_reason=None, stop_reason=None) -> str:
            choice = CompletionResponseChoice(
                index=0, text=text, finish_reason=finish_reason, stop_reason=stop_reason
            )
            return sse(CompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=[choice]
            ))

        sent, num_generated, finished = 0, 0, False
        try:
            async for output in self.engine.generate(prompt_token_ids, params, request_id,
                                                     prompt=prompt):
                completion = output.outputs[0]
                delta, sent = completion.text[sent:], len(completion.text)
                num_generated = len(completion.token_ids)
                if output.finished:
                    finished = True
                    mark_finished()
                    yield chunk(delta, completion.finish_reason or "stop", completion.stop_reason)
                elif delta:
                    yield chunk(delta)
        except Exception as exc:  # noqa: BLE001 - reported in the stream, the server lives on
            yield self.stream_error(exc)
            yield SSE_DONE
            return
        if not finished:  # the engine's iterator ended without a final output
            yield chunk("", "abort")
        if include_usage:
            yield sse(CompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=[],
                usage=usage_info(len(prompt_token_ids), num_generated),
            ))
        yield SSE_DONE
