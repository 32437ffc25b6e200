"""The OpenAI-compatible HTTP server: ``build_app(engine, options)`` and
``run_server(config, options)`` (see :class:`~.server_options.ServerOptions`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(with ``GET`` and ``DELETE /v1/responses/{id}``), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (see :mod:`pyxllm.entrypoints.anthropic`), and with
a pooling task (``--task embed``, ``score``, ``classify``) instead of those
``POST /v1/embeddings`` (see :mod:`.pooling.embedding`), vLLM's ``POST /v1/score`` and
``POST /v1/rerank`` (also ``/score``, ``/rerank``, ``/v2/rerank``; see :mod:`.pooling.score`),
``POST /classify`` and ``POST /pooling`` (see :mod:`.pooling.serving`),
``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (200, with a JSON body while data-parallel replicas
are missing, or 503 when the engine loop died),
``GET /debug/stats`` (``engine.stats()``: running/waiting requests, KV blocks in use),
``GET /metrics`` (Prometheus text format, see :mod:`pyxllm.engine.metrics`), ``GET /version``,
and vLLM's ``POST /tokenize`` and ``POST /detokenize`` (see :mod:`.tokenization.serving`);
``GET /`` is the chat page unless ``--disable-web-ui`` or a pooling task (see :mod:`.web_ui`).
Who may call them (``--api-key``, CORS) is :mod:`.middleware.security`'s; TLS is uvicorn's.

With ``--data-parallel-size N`` the engine is N replica processes behind a router
(:mod:`pyxllm.engine.data_parallel`); the routes are the same.

When the engine reports a fatal error (a tensor-parallel worker died, or every data-parallel
replica), ``/health`` answers 503, the server stops about a second later and :func:`run_server`
raises ``DistributedError`` naming the rank or replicas; should the graceful stop hang, the
process exits with status 1 after 20 s.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from pyxllm.config import EngineConfig, load_chat_template
from pyxllm.distributed.errors import DistributedError
from pyxllm.engine.async_engine import AsyncEngine
from pyxllm.engine.data_parallel.client import DataParallelEngine
from pyxllm.engine.protocol import EngineClient
from pyxllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pyxllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pyxllm.entrypoints.log_setup import ensure_logging
from pyxllm.entrypoints.openai.chat.reasoning import check_reasoning_parser
from pyxllm.entrypoints.openai.chat.serving import OpenAIServingChat, choose_auto_tool_parser
from pyxllm.entrypoints.openai.chat.tool_parsers import get_tool_parser
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import AUTO, NONE
from pyxllm.entrypoints.openai.completions.serving import OpenAIServingCompletion
from pyxllm.entrypoints.openai.errors import (
    OpenAIError,
    OpenAIRoute,
    error_response,
    install_exception_handlers,
)
from pyxllm.entrypoints.openai.middleware.access_log import AccessLog
from pyxllm.entrypoints.openai.middleware.limits import AdmissionControl, BodySizeLimit
from pyxllm.entrypoints.openai.middleware.security import install_security
from pyxllm.entrypoints.openai.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pyxllm.entrypoints.openai.pooling.serving import OpenAIServingPooling
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestModel,
)
from pyxllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pyxllm.entrypoints.openai.responses.serving import OpenAIServingResponses
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.entrypoints.openai.serving_lora import load_lora, runtime_updating_allowed
from pyxllm.entrypoints.openai.serving_lora import router as lora_router
from pyxllm.entrypoints.openai.tokenization.serving import (
    DetokenizeRequest,
    OpenAIServingTokenization,
    TokenizeRequest,
)
from pyxllm.entrypoints.openai.web_ui import install_web_ui

logger = logging.getLogger(__name__)

router = APIRouter(route_class=OpenAIRoute)


def _model_cards(raw_request: Request) -> list[ModelCard]:
    """One card per served name (``--served-model-name a b``), the first first, then one per
    LoRA adapter (its ``root`` its directory, its ``parent`` the served model)."""
    engine = raw_request.app.state.engine
    names = engine.served_model_names
    return [
        ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
        for name in names
    ] + [
        ModelCard(
            id=name,
            root=lora.lora_path,
            parent=lora.base_model_name or engine.model_name,
            max_model_len=engine.max_model_len,
        )
        for name, lora in engine.lora_requests.items()
    ]


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 with an empty body while the engine is healthy; 200 with a JSON body saying what is
    gone while it serves degraded (a data-parallel replica died); 503 when it cannot serve."""
    engine = raw_request.app.state.engine
    try:
        engine.check_health()
    except Exception as exc:  # noqa: BLE001 - any failure means "unhealthy"
        return error_response(f"the engine is not healthy: {exc}", 503)
    detail = engine.health_detail()
    return Response(status_code=200) if detail is None else JSONResponse(detail)


@router.get("/debug/stats")
async def debug_stats(raw_request: Request) -> JSONResponse:
    """The engine's counters: ``num_running``, ``num_waiting``, KV blocks total and used (with
    data parallelism, summed, and per replica under ``replicas``)."""
    return JSONResponse(await run_in_threadpool(raw_request.app.state.engine.stats))


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """The engine's Prometheus metrics, in the text exposition format (collected off the event
    loop: with data parallelism the replicas are asked)."""
    registry = raw_request.app.state.engine.metrics.registry
    body = await run_in_threadpool(generate_latest, registry)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> JSONResponse:
    """The pyxllm version."""
    try:
        return JSONResponse({"version": package_version("pyxllm")})
    except PackageNotFoundError:
        return JSONResponse({"version": "unknown"})


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    """The served model (one entry per served name), in OpenAI's list shape."""
    return JSONResponse(ModelList(data=_model_cards(raw_request)).model_dump(mode="json"))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> JSONResponse:
    """One model's card; 404 for a name other than the served ones."""
    for card in _model_cards(raw_request):
        if model_id == card.id:
            return JSONResponse(card.model_dump(mode="json"))
    raise OpenAIError(f"The model `{model_id}` does not exist.", 404, "model")


def _check_fields(request: RequestModel, raw_request: Request) -> None:
    """A 400 naming a body field pyxllm does not know, or with ``--ignore-unknown-fields`` a log
    line (see :meth:`RequestModel.check_unknown_fields`)."""
    request.check_unknown_fields(raw_request.app.state.ignore_unknown_fields)


# the routes admitted by AdmissionControl: those that run the engine, and those whose one
# request can hold the tokenizer thread for a second (a body of a million tokens)
ADMITTED_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/classify",
    "/pooling",
    "/tokenize",
    "/detokenize",
)


# what a pooling task's server makes, and the routes that serve it
_POOLING_ROUTES = {
    "embed": ("embeddings", "/v1/embeddings"),
    "score": ("scores", "/v1/score or /v1/rerank"),
    "classify": ("classes", "/classify"),
}


def _check_generates(raw_request: Request) -> None:
    """400 on a text route when the server runs another task (``--task embed``, ``score``,
    ``classify``), naming it and the routes that serve it."""
    task = raw_request.app.state.engine.task
    if task != "generate":
        makes, routes = _POOLING_ROUTES.get(task, ("no text", "another route"))
        raise OpenAIError(
            f"{raw_request.url.path}: this server runs --task {task}, which makes {makes}, "
            f"not text: use {routes} (text needs a server started with --task generate)",
            400,
            "model",
        )


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    """OpenAI embeddings (with ``--task embed``; see :mod:`.pooling.embedding`)."""
    _check_fields(request, raw_request)
    handler: OpenAIServingPooling = raw_request.app.state.openai_serving_embedding
    return await handler.create_embedding(request, raw_request)


@router.post("/v1/score")
@router.post("/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    """vLLM's scores: cosine similarities of embeddings, or a cross-encoder's (see
    :mod:`.pooling.score`)."""
    _check_fields(request, raw_request)
    handler: OpenAIServingPooling = raw_request.app.state.openai_serving_embedding
    return await handler.create_score(request, raw_request)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    """vLLM's (Jina's, Cohere's) rerank: documents by similarity to the query."""
    _check_fields(request, raw_request)
    handler: OpenAIServingPooling = raw_request.app.state.openai_serving_embedding
    return await handler.create_rerank(request, raw_request)


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    """vLLM's classification: class probabilities (see :mod:`.pooling.serving`)."""
    _check_fields(request, raw_request)
    handler: OpenAIServingPooling = raw_request.app.state.openai_serving_embedding
    return await handler.create_classify(request, raw_request)


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    """vLLM's pooling: the model's pooled output (see :mod:`.pooling.serving`)."""
    _check_fields(request, raw_request)
    handler: OpenAIServingPooling = raw_request.app.state.openai_serving_embedding
    return await handler.create_pooling(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI chat completions, streamed (SSE) or not."""
    _check_fields(request, raw_request)
    _check_generates(raw_request)
    handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
    return await handler.create_chat_completion(request, raw_request)


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    """OpenAI (legacy) text completions, streamed (SSE) or not."""
    _check_fields(request, raw_request)
    _check_generates(raw_request)
    handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
    return await handler.create_completion(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    """OpenAI's Responses API, streamed (SSE events) or not (see :mod:`.responses.serving`)."""
    _check_fields(request, raw_request)
    _check_generates(raw_request)
    handler: OpenAIServingResponses = raw_request.app.state.openai_serving_responses
    return await handler.create_response(request, raw_request)


@router.post("/v1/messages")
async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
    """Anthropic's Messages API, streamed (SSE events) or not (see
    :mod:`pyxllm.entrypoints.anthropic.serving_messages`)."""
    _check_fields(request, raw_request)
    _check_generates(raw_request)
    handler: AnthropicServingMessages = raw_request.app.state.anthropic_serving_messages
    return await handler.create_message(request, raw_request)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(request: CountTokensRequest, raw_request: Request) -> JSONResponse:
    """The input tokens of an Anthropic Messages request: ``{"input_tokens"}``."""
    _check_fields(request, raw_request)
    _check_generates(raw_request)
    handler: AnthropicServingMessages = raw_request.app.state.anthropic_serving_messages
    return await handler.count_tokens(request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> JSONResponse:
    """A stored response (404 when it is not stored)."""
    handler: OpenAIServingResponses = raw_request.app.state.openai_serving_responses
    return handler.retrieve(response_id, raw_request)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
    """Forget a stored response (404 when it is not stored)."""
    handler: OpenAIServingResponses = raw_request.app.state.openai_serving_responses
    return handler.delete(response_id, raw_request)


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> JSONResponse:
    """Token ids of a prompt or of chat messages: ``{"count", "max_model_len", "tokens"}``."""
    _check_fields(request, raw_request)
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    response = await handler.tokenize(request)
    return _json(response, exclude_none=True)


@router.get("/tokenizer_info")
async def tokenizer_info(raw_request: Request) -> JSONResponse:
    """The tokenizer's configuration (vLLM's endpoint), with ``--enable-tokenizer-info-endpoint``;
    a 404 without it."""
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    return JSONResponse(handler.tokenizer_info())


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    """The text of token ids: ``{"prompt"}``."""
    _check_fields(request, raw_request)
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    return _json(await handler.detokenize(request))


def _json(model: BaseModel, **dump_options: Any) -> Response:
    """``model`` as a JSON response, serialised by pydantic-core: for a million token ids
    ~70 ms of the event loop, against ~270 ms through ``JSONResponse`` (same bytes)."""
    return Response(model.model_dump_json(**dump_options), media_type="application/json")


def build_app(engine: EngineClient, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`~pyxllm.engine.async_engine.AsyncEngine`,
    or a :class:`~pyxllm.engine.data_parallel.client.DataParallelEngine`) with ``options`` (the
    defaults when ``None``; see :class:`ServerOptions`).

    The app does not own the engine: whoever built the engine shuts it down.

    Raises:
        ValueError: an unknown reasoning or tool-call parser name.
    """
    options = options or ServerOptions()
    app = FastAPI(
        title="pyxllm",
        summary="OpenAI-compatible API of a pyxllm engine",
        root_path=options.root_path,
    )
    app.include_router(router)
    if runtime_updating_allowed(options.allow_runtime_lora_updating):
        app.include_router(lora_router)
    app.state.engine = engine
    app.state.ignore_unknown_fields = options.ignore_unknown_fields
    if engine.input_processor.structured_outputs is not None:  # ready for the first constraint
        engine.input_processor.structured_outputs.prepare()
    app.state.openai_serving_chat = OpenAIServingChat(engine, options)
    app.state.openai_serving_completion = OpenAIServingCompletion(engine, options)
    app.state.openai_serving_embedding = OpenAIServingPooling(engine, options)
    app.state.openai_serving_responses = OpenAIServingResponses(app.state.openai_serving_chat)
    app.state.anthropic_serving_messages = AnthropicServingMessages(app.state.openai_serving_chat)
    app.state.openai_serving_tokenization = OpenAIServingTokenization(
        engine, app.state.openai_serving_chat, options.enable_tokenizer_info_endpoint
    )
    install_exception_handlers(app)
    # added first, so inside the key check and CORS (a 413 or 503 carries CORS headers too)
    app.add_middleware(BodySizeLimit, max_bytes=options.limits.max_request_body_bytes)
    app.add_middleware(
        AdmissionControl,
        max_requests=engine.data_parallel_size * engine.max_num_seqs + options.max_waiting_requests,
        paths=ADMITTED_PATHS,
    )
    chat_page = options.web_ui and getattr(engine, "task", "generate") == "generate"
    install_security(app, options, install_web_ui(app) if chat_page else frozenset())
    if options.access_log:  # added last: outermost, so it sees every other middleware's answers
        app.add_middleware(AccessLog)
    return app


LISTEN_BACKLOG = 2048  # connections waiting to be accepted, uvicorn's default
_FATAL_GRACE_S = 1.0  # /health answers 503 this long before the server stops
_FATAL_HARD_EXIT_S = 20.0


class _Server(uvicorn.Server):
    """A uvicorn server that logs one line with the URL once it is listening, and stops when
    ``engine.fatal_error()`` says the engine is lost (``fatal`` then holds the reason; the open
    requests fail with it first, ``engine.fail_requests``).

    On SIGTERM/SIGINT uvicorn stops listening (new connections are refused, as a load balancer
    expects), closes idle keep-alive connections, and waits up to ``--shutdown-timeout``
    seconds for running requests; a request that still reaches a handler gets a 503. Past the
    timeout the remaining requests are cancelled, which aborts them in the engine.
    """

    def __init__(self, config: uvicorn.Config, banner: str, engine: EngineClient | None = None):
        super().__init__(config)
        self.banner, self.engine = banner, engine
        self.fatal: str | None = None
        self._fatal_at = 0.0

    def handle_exit(self, sig: int, frame) -> None:
        app = self.config.app
        for handler in (app.state.openai_serving_chat, app.state.openai_serving_completion):
            handler.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.fatal is None and self.engine is not None and (fatal := self.engine.fatal_error()):
            self.fatal, self._fatal_at = fatal, time.monotonic()
            logger.error("%s; stopping the server", fatal)
            self.engine.fail_requests(fatal)  # their streams end with the error before we stop
            timer = threading.Timer(_FATAL_HARD_EXIT_S, os._exit, args=(1,))
            timer.daemon = True
            timer.start()
        if self.fatal is not None and time.monotonic() - self._fatal_at >= _FATAL_GRACE_S:
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info(self.banner)


@contextmanager
def _signals_handled_by_uvicorn():
    """Let SIGINT/SIGTERM end the server gracefully and then return, not kill the process.

    uvicorn shuts down on these signals, then re-raises them to the handlers it found
    installed; installing no-op handlers first makes that re-raise harmless, so the caller's
    ``finally`` (engine shutdown) runs and the process exits normally.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, so that a port in use fails before
    the model loads and the port is this server's while it loads: a second server started
    meanwhile gets the error too (a socket only bound, with ``SO_REUSEADDR``, would let it bind
    the same port and then serve nothing). Connections made during the load wait in the
    backlog and are answered once the server starts.

    Raises:
        ValueError: the address is in use or cannot be bound (naming ``--port`` or ``--host``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: {host}:{port} is already in use (another server?); choose "
                "another --port or stop what listens there"
            ) from None
        raise ValueError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"
        ) from None
    return sock


def exposure_warning(host: str, api_keys) -> str | None:
    """The start-up warning of a server that listens beyond this machine (``host`` not a
    loopback address or ``localhost``) with no API key (``api_keys`` empty), else ``None``."""
    if api_keys:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"--host {host} listens beyond this machine and no API key is set: anyone who can reach "
        "it can use the model (set --api-key or PYXLLM_API_KEY)"
    )


def run_server(config: EngineConfig, options: ServerOptions | None = None) -> None:
    """Load the engine, serve it over HTTP as ``options`` say until SIGINT/SIGTERM, then shut
    the engine down. pyxllm logs one line with the URLs (the API's, the chat page's) once it
    listens.

    The address is bound before the model loads, so a port in use fails at once.

    Raises:
        ValueError: an unknown reasoning or tool-call parser name, ``--enable-auto-tool-choice``
            with a ``--chat-template`` no tool-call parser reads, or an address that cannot be
            bound (all before the model loads).
        DistributedError: the server stopped because a tensor-parallel worker died, or every
            data-parallel replica did (naming them).
    """
    options = options or ServerOptions()
    if options.reasoning_parser:
        check_reasoning_parser(options.reasoning_parser)
    elif options.reasoning_budget is not None:
        raise ValueError("--reasoning-budget: needs --reasoning-parser")
    if options.tool_call_parser not in (None, AUTO, NONE):
        get_tool_parser(options.tool_call_parser)
    if options.enable_auto_tool_choice and config.chat_template is not None:
        # the template is known before the model loads: a promise of "auto" no parser can
        # keep fails now, not after the load (the tokenizer's own template is checked later)
        choose_auto_tool_parser(options, load_chat_template(config.chat_template))
    ensure_logging()
    sock = bind_socket(options.host, options.port)
    warning = exposure_warning(options.host, options.api_keys)
    if warning:
        logger.warning("%s", warning)
    try:
        if options.data_parallel_size > 1:
            engine = DataParallelEngine(
                config, options.data_parallel_size, options.dp_routing, options.stats_interval
            )
        else:
            engine = AsyncEngine.from_config(config, options.stats_interval)
    except BaseException:
        sock.close()
        raise
    server = None
    try:
        for module in options.lora_modules:
            try:
                asyncio.run(load_lora(engine, **module))
            except OpenAIError as exc:
                raise ValueError(f"--lora-modules {module['name']}: {exc.message}") from exc
        app = build_app(engine, options)
        host, port = options.host, options.port
        shown_host = f"[{host}]" if ":" in host else host
        scheme = "https" if options.ssl_certfile else "http"
        root = f"{scheme}://{shown_host}:{port}/"
        names = engine.served_model_names
        banner = (
            f"serving {engine.model_name} (max_model_len={engine.max_model_len}) at {root}v1"
            + (f"; also served as {', '.join(names[1:])}" if len(names) > 1 else "")
            + (f"; routes also under --root-path {options.root_path}" if options.root_path else "")
            + ("; an API key is required" if options.api_keys else "")
            + (f"; chat page at {root}" if options.web_ui and engine.task == "generate" else "")
        )
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=options.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=options.shutdown_timeout,
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
            ssl_ca_certs=options.ssl_ca_certs,
            ssl_cert_reqs=options.ssl_cert_reqs,
        )
        server = _Server(uv_config, banner, engine)
        # What start-up made (the model, torch's, transformers' and the app's objects: several
        # hundred thousand) lives as long as the server: frozen, the garbage collector's full
        # passes stop walking it between steps (vLLM's engine core does the same). A profile of
        # batch-1 decode spent ~2 % of its time in those passes.
        gc.collect()
        gc.freeze()
        with _signals_handled_by_uvicorn():
            server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()
        logger.info("server stopped")
    if server.fatal:
        raise DistributedError(server.fatal)
