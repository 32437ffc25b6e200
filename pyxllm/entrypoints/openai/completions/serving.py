"""``POST /v1/completions``: prompt text or token ids -> engine -> JSON or SSE chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.engine.input_processor import EngineRequest, TextPrompt, TokensPrompt
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.logprobs import completion_logprobs
from pyxllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from pyxllm.entrypoints.openai.serving_engine import (
    ChoiceEvents,
    ClientDisconnected,
    OpenAIServing,
    sse,
)
from pyxllm.outputs import CompletionOutput, RequestOutput


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
        self.check_not_draining()
        if request.suffix:
            raise OpenAIError("suffix: not supported", 400, "suffix")
        echo_only = bool(request.echo) and request.max_tokens == 0
        extra = {"logprobs": request.logprobs}
        if request.echo and request.logprobs is not None:
            extra["prompt_logprobs"] = request.logprobs
        params = self.sampling_params(request, 1 if echo_only else request.max_tokens, **extra)
        prompt = completion_prompt(request)
        if isinstance(prompt, str):
            prompt = await self.tokenize(prompt)
        engine_request = self.processor.process(
            f"cmpl-{uuid.uuid4().hex}",
            prompt,
            params,
            lora_request=self.lora_request(request.model),
        )
        search = self.beam_search(request, engine_request)
        await self.prepare(engine_request)
        echo = None
        if request.echo:
            ids, text = engine_request.prompt_token_ids, engine_request.prompt
            if text is None:
                text = self.engine.tokenizer.decode(ids, skip_special_tokens=False)
            echo = _Echo(text, ids, echo_only)
        choices = _CompletionChoices(engine_request, echo, self.engine.tokenizer.decode_each)
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            events = _CompletionEvents(
                engine_request.request_id, choices, created, self.response_model(engine_request)
            )
            return self.stream(engine_request, events, include_usage, search)
        try:
            final = await self.generate_full(engine_request, raw_request, search)
        except ClientDisconnected:
            return Response(status_code=499)
        response = CompletionResponse(
            id=engine_request.request_id,
            created=created,
            model=self.response_model(engine_request),
            choices=[choices.full(completion, final) for completion in final.outputs],
            usage=self.usage(engine_request, choices.completion_tokens, final),
        )
        return JSONResponse(response.model_dump(mode="json"))


def completion_prompt(request: CompletionRequest) -> TextPrompt | TokensPrompt:
    """The request's one prompt: a string, or a list of token ids (a list of one of either);
    the input processor checks it.

    Raises:
        OpenAIError: more than one prompt.
    """
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(
                f"prompt: only one prompt per request is supported for now, got {len(prompt)}",
                400,
                "prompt",
            )
        prompt = prompt[0]
    return TextPrompt(prompt) if isinstance(prompt, str) else TokensPrompt(prompt)


@dataclass(slots=True)
class _Echo:
    """The prompt to put before each choice: its text, its token ids, and whether it is the
    whole choice (``max_tokens: 0``)."""

    text: str
    token_ids: list[int]
    only: bool


class _CompletionChoices:
    """Each choice's text and logprobs past what was sent, for the whole response or a stream.

    Args:
        request: the engine request (its params say whether logprobs were asked for).
        echo: the prompt to put first, if the request asked for it.
        decode_each: the tokenizer's per-token decoding (logprobs' token strings).
    """

    def __init__(self, request: EngineRequest, echo: _Echo | None, decode_each) -> None:
        self.params, self.echo, self.decode_each = request.sampling_params, echo, decode_each
        n = self.params.n
        self.chars_sent, self.tokens_sent = [0] * n, [0] * n

    def delta(
        self, completion: CompletionOutput, output: RequestOutput
    ) -> tuple[str, CompletionLogProbs | None]:
        """``(text, logprobs)`` of a choice past what was sent, and mark it sent; with
        ``echo``, nothing sent yet means the prompt comes first. ``logprobs`` is ``None``
        unless the request asked for them."""
        i, echo = completion.index, self.echo
        chars_sent, tokens_sent = self.chars_sent[i], self.tokens_sent[i]
        first = chars_sent == 0 and tokens_sent == 0
        text, ids, lps = "", [], []
        if echo is not None and first:
            text, ids = echo.text, list(echo.token_ids)
            lps = list(output.prompt_logprobs or [None] * len(ids))
        if echo is None or not echo.only:
            echoed = len(echo.text) if echo is not None and not first else 0
            text += completion.text[chars_sent - echoed :]
            ids += completion.token_ids[tokens_sent:]
            lps += (completion.logprobs or [])[tokens_sent:]
        self.chars_sent[i] += len(text)
        self.tokens_sent[i] = len(completion.token_ids)
        if self.params.logprobs is None:
            return text, None
        logprobs = completion_logprobs(ids, lps, self.params.logprobs, chars_sent, self.decode_each)
        return text, logprobs

    def full(self, completion: CompletionOutput, output: RequestOutput) -> CompletionResponseChoice:
        """The whole choice of a finished request."""
        text, logprobs = self.delta(completion, output)
        return CompletionResponseChoice(
            index=completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    @property
    def completion_tokens(self) -> int:
        """Generated tokens sent (none when the choices are the echoed prompt alone)."""
        return 0 if self.echo is not None and self.echo.only else sum(self.tokens_sent)


class _CompletionEvents(ChoiceEvents):
    """A completion stream's events: per choice text deltas (with logprobs if asked), the last
    one with the finish reason."""

    def __init__(
        self, request_id: str, choices: _CompletionChoices, created: int, model: str
    ) -> None:
        self.request_id, self.choices, self.created, self.model = (
            request_id,
            choices,
            created,
            model,
        )

    def chunk(self, choices: list[CompletionResponseChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            CompletionStreamResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def update(self, completion: CompletionOutput, output: RequestOutput) -> str | None:
        text, logprobs = self.choices.delta(completion, output)
        if completion.finish_reason is None and not text and not (logprobs and logprobs.tokens):
            return None
        choice = CompletionResponseChoice(
            index=completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        return self.chunk([choice])

    def aborted(self, index: int) -> str:
        return self.chunk([CompletionResponseChoice(index=index, text="", finish_reason="abort")])

    def usage(self, usage: UsageInfo) -> str:
        return self.chunk([], usage)

    @property
    def completion_tokens(self) -> int:
        return self.choices.completion_tokens
