"""What chat and completion serving share: checks, sampling parameters, processing a request
through the engine's input processor, and running it so that a client that goes away aborts it
(streamed or not); the SSE stream's skeleton is written once here."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pyxllm.engine.beam_search import BeamSearch, run_beam_search
from pyxllm.engine.errors import ConstraintFailedError, EngineDeadError
from pyxllm.engine.input_processor import ChatPrompt, EngineRequest, TextPrompt, TokensPrompt
from pyxllm.engine.protocol import EngineClient
from pyxllm.entrypoints.openai.beam_search import check_beam_search_fields, new_beam_search
from pyxllm.entrypoints.openai.errors import OpenAIError, error_body, param_from_message
from pyxllm.entrypoints.openai.middleware.request_logger import RequestLogger, RequestWatch
from pyxllm.entrypoints.openai.protocol import PromptTokenUsageInfo, SamplingFields, UsageInfo
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.entrypoints.openai.structured_outputs import requested_constraint
from pyxllm.lora_request import LoRARequest
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Request fields passed to SamplingParams as given (None: not given, SamplingParams' default;
# for the model-defaultable ones, the model's generation_config value).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
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


def usage_info(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> UsageInfo:
    """The ``usage`` of a request from its token counts; with ``cached_tokens`` (the prompt
    tokens served from the prefix cache) also ``prompt_tokens_details``."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=None
        if cached_tokens is None
        else PromptTokenUsageInfo(cached_tokens=cached_tokens),
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


# The one thread that tokenizes and renders chat templates for the server (see tokenize()).
_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="pyxllm-tokenizer")

# Fields pyxllm declares but does not honour, with the values that are the same as leaving
# them out (anything else is refused).
_NOT_HONOURED = {
    "best_of": (None, 1),
    "prompt_logprobs": (None,),
    # The grammar backend is the server's (--structured-outputs-backend), as in vLLM v1, which
    # dropped per-request selection; the JSON whitespace bound is JSON_WHITESPACE_LIMIT.
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
}


def unsupported_fields(request: SamplingFields) -> Iterator[tuple[str, str]]:
    """``(field, its value as text)`` for each field of ``request`` pyxllm cannot honour: the
    :data:`_NOT_HONOURED` ones set to anything but what leaving them out means, and
    ``stream_options.continuous_usage_stats``."""
    for name, neutral in _NOT_HONOURED.items():
        value = getattr(request, name, None)
        if name == "best_of" and value == request.n:
            continue  # best_of n of n samples is n samples
        if value not in neutral:
            shown = repr(value)
            yield name, shown if len(shown) <= 60 else shown[:57] + "..."
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        yield "stream_options.continuous_usage_stats", "true"


class ChoiceEvents(abc.ABC):
    """What one streamed endpoint sends about its choices (chat: message deltas; completions:
    text), in the skeleton of :meth:`OpenAIServing.stream`.

    The skeleton calls :meth:`opening` once, :meth:`update` for each new output of a choice
    that has not finished, :meth:`aborted` for a choice the engine left unfinished, and
    :meth:`closing` last (or :meth:`failed`, when an error ends the stream).
    """

    def opening(self) -> Iterator[str]:
        """Events before the first output (none by default)."""
        return iter(())

    def closing(self, usage: UsageInfo | None) -> Iterator[str]:
        """The last events: :meth:`usage` when the request asked for it (``usage`` is then
        given), and ``[DONE]``."""
        if usage is not None:
            yield self.usage(usage)
        yield SSE_DONE

    def failed(self, error: OpenAIError) -> Iterator[str]:
        """The events of an error after the stream started: an error event, and ``[DONE]``."""
        yield sse(error_body(error.message, error.status_code, error.param))
        yield SSE_DONE

    @abc.abstractmethod
    def update(self, completion: CompletionOutput, output: RequestOutput) -> str | None:
        """The event for a choice's new state (with its finish reason once ``completion``
        finished), or ``None`` when there is nothing new to send."""

    @abc.abstractmethod
    def aborted(self, index: int) -> str:
        """The closing event of choice ``index``, which ended without a finish reason."""

    @abc.abstractmethod
    def usage(self, usage: UsageInfo) -> str:
        """The last event: the request's token counts, no choices."""

    @property
    @abc.abstractmethod
    def completion_tokens(self) -> int:
        """Generated tokens sent so far, over every choice (the usage's completion tokens)."""


class OpenAIServing:
    """Base of the chat and completion handlers, bound to one engine (an
    :class:`~pyxllm.engine.protocol.EngineClient`).

    A handler builds the request's prompt and :class:`SamplingParams`, then calls the engine's
    input processor (:attr:`processor`) once; its ``InvalidRequestError`` becomes a 400 naming
    the field (:mod:`.errors`)."""

    def __init__(self, engine: EngineClient, options: ServerOptions | None = None):
        self.engine = engine
        self.processor = engine.input_processor
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.options = options or ServerOptions()
        self.limits = self.options.limits
        self.max_n = self.limits.max_n or engine.max_num_seqs
        self.draining = False
        self.served_model_names: tuple[str, ...] = engine.served_model_names
        self.request_logger = (
            RequestLogger(engine.tokenizer, self.options.max_log_len)
            if self.options.enable_log_requests
            else None
        )

    async def tokenize(self, prompt: str | TextPrompt | ChatPrompt) -> TokensPrompt:
        """``processor.tokenize(prompt)`` on the tokenizer thread, off the event loop (a chat
        template or a long prompt takes a while; one thread, as transformers' tokenizers are
        not safe to call from several at once).

        Raises:
            InvalidRequestError: see :meth:`InputProcessor.tokenize`.
        """
        return await self.on_tokenizer_thread(self.processor.tokenize, prompt)

    async def on_tokenizer_thread(self, fn, *args):
        """``fn(*args)`` on the tokenizer thread (see :meth:`tokenize`), its result or its
        exception."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_TOKENIZER_THREAD, fn, *args)

    # --- checks -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is one of the served names or LoRA adapters (a missing model
        means the first name)."""
        served = self.served_model_names
        if model is not None and model not in served and model not in self.engine.lora_requests:
            names = ", ".join(f"`{name}`" for name in (*served, *self.engine.lora_requests))
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves {names}.", 404, "model"
            )

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, ``None`` for the base model."""
        return None if model is None else self.engine.lora_requests.get(model)

    def response_model(self, request: EngineRequest) -> str:
        """The ``model`` an answer reports: its LoRA adapter's name, else the served model's
        first name (vLLM's rule)."""
        lora = request.lora_request
        return self.model_name if lora is None else lora.lora_name

    def usage(
        self, request: EngineRequest, completion_tokens: int, output: RequestOutput | None
    ) -> UsageInfo:
        """The request's ``usage``; with ``--enable-prompt-tokens-details`` also the prompt
        tokens its ``output`` says came from the prefix cache."""
        cached = None
        if self.options.enable_prompt_tokens_details:
            cached = (output.num_cached_tokens if output is not None else None) or 0
        return usage_info(len(request.prompt_token_ids), completion_tokens, cached)

    def check_health(self) -> None:
        """503 when the engine loop has died."""
        try:
            self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means the engine cannot serve
            raise OpenAIError(f"the engine is not healthy: {exc}", 503) from exc

    def check_not_draining(self) -> None:
        """503 with ``Retry-After`` while the server drains for shutdown (the number of
        requests in progress is bounded before, by ``limits.AdmissionControl``)."""
        if self.draining:
            raise OpenAIError("the server is shutting down", 503, headers={"Retry-After": "5"})

    def check_limits(self, request: SamplingFields) -> None:
        """400 naming the field of a request that asks for more than :class:`RequestLimits`
        allows (``n``, ``stop``, ``logit_bias``)."""
        limits = self.limits
        if request.n is not None and request.n > self.max_n:
            raise OpenAIError(
                f"n: must be at most {self.max_n} (--max-n), got {request.n}", 400, "n"
            )
        stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
        if len(stop) > limits.max_stop:
            raise OpenAIError(
                f"stop: at most {limits.max_stop} stop strings, got {len(stop)}", 400, "stop"
            )
        if any(len(s) > limits.max_stop_length for s in stop):
            raise OpenAIError(
                f"stop: a stop string may have at most {limits.max_stop_length} characters",
                400,
                "stop",
            )
        if request.logit_bias and len(request.logit_bias) > limits.max_logit_bias:
            raise OpenAIError(
                f"logit_bias: at most {limits.max_logit_bias} entries, "
                f"got {len(request.logit_bias)}",
                400,
                "logit_bias",
            )

    def check_unsupported(self, request: SamplingFields) -> None:
        """400 for a field pyxllm cannot honour in the form given, or a combination that makes
        no sense, rather than answering as if it were absent."""
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "stream_options: only allowed when stream is true", 400, "stream_options"
            )
        for name, value in unsupported_fields(request):
            raise OpenAIError(f"{name}: {value} is not supported", 400, name.split(".")[0])

    def sampling_fields(self, request: SamplingFields, max_tokens: int | None, **extra) -> dict:
        """The request's :class:`SamplingParams` fields, by name: the one mapping from request
        fields to sampling parameters, after the checks that need no tokenizer. A field the
        request leaves unset stays out (the input processor gives it the model's
        generation_config value); ``extra`` fields (``logprobs``, ``prompt_logprobs``) are
        passed as given. Build the parameters with :meth:`build_sampling_params`.

        Raises:
            OpenAIError: 400 naming a field pyxllm cannot honour, one over the server's
                limits, or one that beam search (``use_beam_search``) cannot combine with.
        """
        self.check_unsupported(request)
        self.check_limits(request)
        fields = {name: getattr(request, name) for name in SAMPLING_FIELDS}
        fields = {name: value for name, value in fields.items() if value is not None}
        fields.update(n=1 if request.n is None else request.n, max_tokens=max_tokens, **extra)
        fields["structured_outputs"] = requested_constraint(request)
        if request.kv_transfer_params is not None:
            fields["extra_args"] = {"kv_transfer_params": request.kv_transfer_params}
        check_beam_search_fields(request, fields)
        return fields

    @staticmethod
    def build_sampling_params(fields: dict) -> SamplingParams:
        """``SamplingParams(**fields)``; raises OpenAIError, a 400 naming the field of a value
        out of range."""
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param_from_message(str(exc))) from exc

    def sampling_params(
        self, request: SamplingFields, max_tokens: int | None, **extra
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`: :meth:`sampling_fields` built at once.

        Raises:
            OpenAIError: 400 naming the field of a value out of range, that pyxllm cannot
                honour or over the server's limits.
        """
        return self.build_sampling_params(self.sampling_fields(request, max_tokens, **extra))

    # --- running a request ----------------------------------------------------------------------

    def engine_error(self, exc: Exception, request_id: str) -> OpenAIError:
        """Map an exception from ``engine.generate`` of ``request_id``: ValueError -> 400, a
        dead engine (or the data-parallel replica that ran the request) -> 503, anything else
        a 500 that names the request id and no more (the log line has the exception), or for
        a failed structured-output constraint one that names the cause too."""
        if isinstance(exc, ConstraintFailedError):  # its message holds nothing to hide
            logger.error("request %s: %s", request_id, exc, exc_info=exc)
            return OpenAIError(f"{exc} (request id {request_id})", 500)
        if isinstance(exc, ValueError):
            return OpenAIError(str(exc), 400, param_from_message(str(exc)))
        if isinstance(exc, EngineDeadError):
            return OpenAIError(f"the engine is not healthy: {exc}", 503)
        try:
            self.engine.check_health()
        except Exception as health_exc:  # noqa: BLE001
            return OpenAIError(f"the engine is not healthy: {health_exc}", 503)
        logger.error(
            "engine error in request %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc
        )
        return OpenAIError(
            f"internal error (request id {request_id}; the server's log has the details)", 500
        )

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine; never raises."""
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - aborting is best effort during cleanup
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def prepare(self, request: EngineRequest) -> EngineRequest:
        """Wait, off the event loop, for the request's constraint to compile, so that one that
        does not is a 400 before the response starts (``InvalidRequestError``); then write
        its arrival line (``--enable-log-requests``)."""
        grammar = self.processor.constraint(request)
        if grammar is not None:
            await grammar.wait()
        if self.request_logger is not None:
            self.request_logger.log_inputs(request)
        return request

    def watch(self, request: EngineRequest) -> RequestWatch | None:
        """The watch writing the request's closing line (``--enable-log-requests``), else
        ``None``."""
        return None if self.request_logger is None else self.request_logger.watch(request)

    def beam_search(
        self, request: SamplingFields, engine_request: EngineRequest
    ) -> BeamSearch | None:
        """The beam search ``request`` asks for (``use_beam_search``), else ``None``; run it by
        passing it to :meth:`generate_full` or :meth:`stream`.

        Raises:
            OpenAIError: 400 naming ``n`` or ``length_penalty`` (see :func:`new_beam_search`).
        """
        if not request.use_beam_search:
            return None
        if engine_request.lora_request is not None:
            raise OpenAIError(
                "use_beam_search: not with a LoRA adapter yet (the beams would run on the base "
                "model)",
                400,
                "use_beam_search",
            )
        return new_beam_search(request, engine_request, self.engine.tokenizer.eos_token_ids)

    def outputs(
        self, request: EngineRequest, search: BeamSearch | None
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs of ``request``, or with a beam ``search`` the one finished
        output of the search from ``request``'s prompt."""
        if search is None:
            return self.engine.generate(request)
        return _beam_outputs(self.engine, request, search)

    async def generate_full(
        self, request: EngineRequest, raw_request: Request, search: BeamSearch | None = None
    ) -> RequestOutput:
        """Run a request (or its beam ``search``) to its end; raises
        :class:`ClientDisconnected` (after aborting the request) if the client goes away first,
        :class:`OpenAIError` if the engine refuses it."""
        finished, watch = False, self.watch(request)

        async def drain() -> RequestOutput:
            nonlocal finished
            final = None
            async for output in self.outputs(request, search):
                final = output
                if watch is not None:
                    watch.observe(output)
            finished = True
            return final

        drain_task = asyncio.ensure_future(drain())
        watch_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({drain_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if not drain_task.done():
                logger.info("client disconnected; aborting %s", request.request_id)
                raise ClientDisconnected(request.request_id)
            try:
                return drain_task.result()
            except (ValueError, RuntimeError) as exc:
                raise self.engine_error(exc, request.request_id) from exc
        finally:
            watch_task.cancel()
            if not drain_task.done():
                drain_task.cancel()
            if not finished:
                self.abort(request.request_id)
            if watch is not None:
                watch.close()

    def stream(
        self,
        request: EngineRequest,
        events: ChoiceEvents,
        include_usage: bool,
        search: BeamSearch | None = None,
    ) -> AbortOnCloseStreamingResponse:
        """The SSE response of ``request``: ``events``' opening, one event per choice update
        (each choice ends with its finish reason, or an ``abort`` one if the engine's outputs
        stop first), then ``events``' closing (given the usage when ``include_usage``). An
        error after the stream started is sent as ``events.failed`` says. The request is
        aborted when the response ends before its last output (client gone, server error).
        With a beam ``search``, its one final output makes one update per choice."""
        state = {"finished": False}
        watch, last = self.watch(request), None

        async def body() -> AsyncIterator[str]:
            nonlocal last
            for event in events.opening():
                yield event
            done = [False] * request.sampling_params.n
            try:
                async for output in self.outputs(request, search):
                    last = output
                    if watch is not None:
                        watch.observe(output)
                    for completion in output.outputs:
                        if done[completion.index]:
                            continue
                        done[completion.index] = completion.finish_reason is not None
                        event = events.update(completion, output)
                        if event is not None:
                            yield event
                    state["finished"] |= output.finished
            except Exception as exc:  # noqa: BLE001 - reported in the stream, the server lives on
                for event in events.failed(self.stream_error(exc, request.request_id)):
                    yield event
                return
            for index, finished in enumerate(done):
                if not finished:
                    yield events.aborted(index)
            usage = self.usage(request, events.completion_tokens, last)
            for event in events.closing(usage if include_usage else None):
                yield event

        def on_close() -> None:
            if watch is not None:
                watch.close()
            if not state["finished"]:
                logger.info("stream closed early; aborting %s", request.request_id)
                self.abort(request.request_id)

        return AbortOnCloseStreamingResponse(body(), on_close)

    def stream_error(self, exc: Exception, request_id: str) -> OpenAIError:
        """The error to report of an exception raised after ``request_id``'s stream started."""
        return exc if isinstance(exc, OpenAIError) else self.engine_error(exc, request_id)


async def _beam_outputs(
    engine: EngineClient, request: EngineRequest, search: BeamSearch
) -> AsyncIterator[RequestOutput]:
    """The finished output of a beam ``search`` from ``request``'s prompt, as the one item of
    an output stream."""
    yield await run_beam_search(engine, request, search)
