"""What ``pyxllm serve`` does around the engine: where it listens, who may call it, how much one
request and the whole server may ask for, and how it stops.

:class:`ServerOptions` is built from the serve flags (``entrypoints/cli.py``) and read by
:func:`~pyxllm.entrypoints.openai.api_server.build_app` and ``run_server``; tests build one
directly. The defaults are the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """How much one request may ask for; beyond a limit it gets a 400 naming the field (a
    413 for the body), before any work is done for it.

    Attributes:
        max_n: samples per request (``n``); ``None`` means the engine's
            ``max_seqs_per_batch`` (``--max-n``).
        max_request_body_bytes: the request body, bytes (``--max-request-body-bytes``).
        max_messages: chat messages per request.
        max_stop: ``stop`` strings per request; max_stop_length: characters in each.
        max_logit_bias: ``logit_bias`` entries.
    """

    max_n: int | None = None
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_messages: int = 2048
    max_stop: int = 64
    max_stop_length: int = 1024
    max_logit_bias: int = 1024


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The HTTP server's settings (the engine's are :class:`~pyxllm.config.EngineConfig`).

    Attributes:
        host, port: where to listen.
        log_level: uvicorn's log level (``--uvicorn-log-level``; its own access log is off).
        access_log: whether each HTTP request gets a log line (:mod:`.access_log`;
            ``--disable-uvicorn-access-log``).
        reasoning_parser: the parser splitting chat text into ``reasoning_content`` and
            ``content`` (a registered name), ``None`` for none.
        reasoning_budget: the ``thinking_token_budget`` of a chat request that sets none
            (``--reasoning-budget``, llama.cpp's flag; ``None``: unlimited); needs a
            ``reasoning_parser``.
        tool_call_parser: the parser of the model's own calls for ``tool_choice: "auto"``: a
            registered name, ``"auto"`` (chosen from the chat template, see
            :mod:`.tool_parsers.auto`), or ``"none"``/``None``, which refuse ``auto``.
        enable_auto_tool_choice: whether ``auto`` must be served (vLLM's flag): the server
            then fails at start-up when there is no parser, instead of refusing ``auto``.
        ignore_unknown_fields: whether a request field pyxllm does not know is logged and
            ignored (vLLM's behaviour) rather than refused with a 400 naming it (OpenAI's).
        api_keys: the accepted ``Authorization: Bearer`` keys; empty: no key needed. Left out
            of ``repr`` so they never reach a log (see :mod:`.security`).
        protect_metrics: whether ``/metrics`` needs a key too (``/health`` never does).
        ssl_keyfile, ssl_certfile: the server's TLS key and certificate (PEM); with a
            certificate the server speaks HTTPS only.
        ssl_ca_certs: CA certificates (PEM) that client certificates are checked against.
        ssl_cert_reqs: whether a client certificate is needed, as :mod:`ssl`'s ints
            (0 ``CERT_NONE``, 1 ``CERT_OPTIONAL``, 2 ``CERT_REQUIRED``), uvicorn's setting.
        allowed_origins: the origins CORS allows (``"*"`` for any); empty: no CORS at all.
        allowed_methods, allowed_headers: the methods and request headers CORS allows.
        allow_credentials: whether CORS allows credentials (cookies, ``Authorization``).
        limits: what one request may ask for (:class:`RequestLimits`).
        max_waiting_requests: requests admitted beyond the engine's ``max_seqs_per_batch``
            running ones; more get a 503 with ``Retry-After``.
        shutdown_timeout: seconds SIGTERM waits for running requests before aborting them.
        trust_request_chat_template: whether a request may bring its own chat template.
        stats_interval: seconds between the engine's stats lines in the log
            (:mod:`pyxllm.engine.stat_logger`); ``None`` logs none (``--disable-log-stats``).
        web_ui: whether ``GET /`` serves the chat page (:mod:`.web_ui`; ``--disable-web-ui``).
        enable_tokenizer_info_endpoint: whether ``GET /tokenizer_info`` answers (vLLM's flag;
            off by default: it shows the chat template).
        root_path: the path prefix a proxy serves the API under (``--root-path``, FastAPI's
            ``root_path``): routes answer with and without it, and the API docs use it.
        enable_log_requests: whether each request gets a log line when it arrives and one when
            it finishes (:mod:`.request_logger`).
        max_log_len: the most characters (and token ids) of a prompt those lines show;
            ``None``: all.
        enable_prompt_tokens_details: whether ``usage`` carries ``prompt_tokens_details``
            (``cached_tokens``: the prompt tokens served from the prefix cache).
        data_parallel_size: engine replicas behind this server (``--data-parallel-size``; 1:
            the engine runs in the server's process, see :mod:`pyxllm.engine.data_parallel`).
        dp_routing: how a request's replica is chosen (``--dp-routing``: ``cache_aware``,
            ``least_loaded`` or ``round_robin``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    access_log: bool = True
    reasoning_parser: str | None = None
    reasoning_budget: int | None = None
    tool_call_parser: str | None = "auto"
    enable_auto_tool_choice: bool = False
    ignore_unknown_fields: bool = False
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_metrics: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_waiting_requests: int = 256
    shutdown_timeout: float = 10.0
    trust_request_chat_template: bool = False
    stats_interval: float | None = 10.0
    web_ui: bool = True
    enable_tokenizer_info_endpoint: bool = False
    root_path: str = ""
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_prompt_tokens_details: bool = False
    data_parallel_size: int = 1
    dp_routing: str = "cache_aware"
