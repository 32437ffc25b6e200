"""What chat and completion serving share: checks, sampling parameters, and running a request
so that a client that goes away aborts it (streaming or not)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pyxllm.entrypoints.openai.errors import OpenAIError, error_body, param_from_message
from pyxllm.entrypoints.openai.protocol import SamplingFields, UsageInfo
from pyxllm.outputs import RequestOutput
from pyxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Fields a model's generation_config.json may default (a request's own value wins).
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
PASSTHROUGH_FIELDS = (
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logit_bias",
    "include_stop_str_in_output",
)


def sse(payload) -> str:
    """One server-sent event carrying a pydantic model as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The ``usage`` of a request from its token counts."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` that calls ``on_close()`` however the response ends.

    Starlette cancels the body iterator when the client disconnects, but a cancelled async
    generator may never run its ``finally``; ``on_close`` (synchronous, so it cannot be
    cancelled) is where the request is aborted.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """Base of the chat and completion handlers, bound to one :class:`AsyncEngine`."""

    def __init__(self, engine):
        self.engine = engine
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        defaults = dict(getattr(engine, "generation_defaults", None) or {})
        if "max_new_tokens" in defaults:
            defaults.setdefault("max_tokens", defaults.pop("max_new_tokens"))
        self.defaults = {k: defaults[k] for k in DEFAULTABLE_FIELDS if defaults.get(k) is not None}

    # --- checks -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served name (a missing model means the served one)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                404,
                "model",
            )

    def check_health(self) -> None:
        """503 when the engine loop has died."""
        try:
            self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means the engine cannot serve
            raise OpenAIError(f"the engine is not healthy: {exc}", 503) from exc

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str) -> None:
        """400 when the prompt plus ``max_tokens`` do not fit ``max_model_len``."""
        limit = self.max_model_len
        if max_tokens is None and num_prompt_tokens >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens (max_model_len). "
                f"However, your {what} has {num_prompt_tokens} tokens, which leaves no room "
                f"for the completion. Please reduce the length of the {what}.",
                400,
                what,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens (max_model_len). "
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the {what}, {max_tokens} for the completion). "
                f"Please reduce the length of the {what} or the completion.",
                400,
                "max_tokens" if num_prompt_tokens < limit else what,
            )

    def fit_to_context(self, params: SamplingParams, num_prompt_tokens: int, what: str) -> None:
        """Check the length (see :meth:`check_length`); when the request left ``max_tokens``
        unset, apply the model's default (``max_new_tokens``), capped to the room left."""
        self.check_length(num_prompt_tokens, params.max_tokens, what)
        default = self.defaults.get("max_tokens")
        if params.max_tokens is None and default is not None:
            params.max_tokens = min(default, self.max_model_len - num_prompt_tokens)

    def check_unsupported(self, request: SamplingFields) -> None:
        """400 for field combinations that make no sense, rather than ignoring them."""
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "stream_options: only allowed when stream is true", 400, "stream_options"
            )

    def sampling_params(
        self, request: SamplingFields, max_tokens: int | None, **extra
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`; generation defaults fill unset fields.

        OpenAI's default temperature (1.0) applies when neither the request nor the model's
        generation config sets one; unset ``max_tokens`` means up to the context limit.
        ``extra`` fields (``logprobs``, ``prompt_logprobs``) are passed as given.
        """
        self.check_unsupported(request)
        fields: dict = {
            "n": 1 if request.n is None else request.n,
            "max_tokens": max_tokens,
            **extra,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(request, name)
            value = self.defaults.get(name) if value is None else value
            if value is not None:
                fields[name] = value
        for name in PASSTHROUGH_FIELDS:
            if getattr(request, name) is not None:
                fields[name] = getattr(request, name)
        for name, value in fields.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise OpenAIError(f"{name}: must be a finite number, got {value}", 400, name)
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param_from_message(str(exc))) from exc
        vocab_size = getattr(self.engine.tokenizer, "vocab_size", None)
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            for token_id in ids:
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    raise OpenAIError(
                        f"{name}: token id {token_id} is out of range [0, {vocab_size})", 400, name
                    )
        return params

    # --- running a request ----------------------------------------------------------------------

    def engine_error(self, exc: Exception) -> OpenAIError:
        """Map an exception from ``engine.generate``: ValueError -> 400, a dead engine -> 503."""
        if isinstance(exc, ValueError):
            return OpenAIError(str(exc), 400, param_from_message(str(exc)))
        try:
            self.engine.check_health()
        except Exception as health_exc:  # noqa: BLE001
            return OpenAIError(f"the engine is not healthy: {health_exc}", 503)
        logger.exception("engine error", exc_info=exc)
        return OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", 500)

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine; never raises."""
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - aborting is best effort during cleanup
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def generate_full(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        raw_request: Request,
        prompt: str | None = None,
    ) -> RequestOutput:
        """Run a request to its end; raises :class:`ClientDisconnected` (after aborting the
        request) if the client goes away first, :class:`OpenAIError` if the engine refuses it."""
        finished = False

        async def drain() -> RequestOutput:
            nonlocal finished
            final = None
            async for output in self.engine.generate(
                prompt_token_ids, params, request_id, prompt=prompt
            ):
                final = output
            finished = True
            return final

        drain_task = asyncio.ensure_future(drain())
        watch_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({drain_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if not drain_task.done():
                logger.info("client disconnected; aborting %s", request_id)
                raise ClientDisconnected(request_id)
            try:
                return drain_task.result()
            except (ValueError, RuntimeError) as exc:
                raise self.engine_error(exc) from exc
        finally:
            watch_task.cancel()
            if not drain_task.done():
                drain_task.cancel()
            if not finished:
                self.abort(request_id)

    def stream(
        self, events: Callable[[Callable[[], None]], AsyncIterator[str]], request_id: str
    ) -> AbortOnCloseStreamingResponse:
        """An SSE response of ``events(mark_finished)``; the request is aborted when the
        response ends before ``mark_finished()`` was called (client gone, server error)."""
        state = {"finished": False}

        def mark_finished() -> None:
            state["finished"] = True

        def on_close() -> None:
            if not state["finished"]:
                logger.info("stream closed early; aborting %s", request_id)
                self.abort(request_id)

        return AbortOnCloseStreamingResponse(events(mark_finished), on_close)

    def stream_error(self, exc: Exception) -> str:
        """The SSE event reporting an error that happened after the stream started."""
        err = exc if isinstance(exc, OpenAIError) else self.engine_error(exc)
        return sse(error_body(err.message, err.status_code, err.param))
