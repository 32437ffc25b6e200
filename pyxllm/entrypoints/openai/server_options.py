"""What ``pyxllm serve`` does around the engine: where it listens, who may call it, how much one
request and the whole server may ask for, and how it stops.

:class:`ServerOptions` is read by :func:`~pyxllm.entrypoints.openai.api_server.build_app` and
``run_server``; tests build one directly. Each field that is a ``pyxllm serve`` flag describes
that flag in its :func:`~pyxllm.flag_fields.flag` metadata (help, group, converter), and the
command builds the options back from the parsed flags with
:func:`~pyxllm.flag_fields.from_namespace`; the defaults are the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyxllm.engine.data_parallel.router import ROUTING_POLICIES
from pyxllm.entrypoints.openai.chat.reasoning import reasoning_parser_choices
from pyxllm.entrypoints.openai.chat.tool_parsers import tool_parser_names
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import AUTO, NONE
from pyxllm.flag_fields import Flag, flag, nested
from pyxllm.flag_types import (
    api_keys,
    float_value,
    int_value,
    lora_modules,
    optional,
    port,
    positive,
    string_list,
)

API_KEY_ENV = "PYXLLM_API_KEY"
# The serve flags' argument groups, in --help's order (before the engine's); run-batch lists
# the response flags under their own title, serve among its server flags.
SERVER_FLAGS, RESPONSE_FLAGS, SECURITY_FLAGS = "server flags", "response flags", "security flags"
LIMIT_FLAGS, LOGGING_FLAGS = "limits and shutdown flags", "logging flags"
SERVER_FLAG_GROUPS = (SERVER_FLAGS, SECURITY_FLAGS, LIMIT_FLAGS, LOGGING_FLAGS)


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

    max_n: int | None = flag(
        None,
        type=positive(int_value),
        metavar="N",
        group=LIMIT_FLAGS,
        help="most samples per request (n); above it a 400 (default: --max-seqs-per-batch)",
    )
    max_request_body_bytes: int = flag(
        8 * 1024 * 1024,
        type=positive(int_value),
        metavar="BYTES",
        group=LIMIT_FLAGS,
        help="largest request body; above it a 413 (default: 8388608, 8 MiB)",
    )
    max_messages: int = 2048
    max_stop: int = 64
    max_stop_length: int = 1024
    max_logit_bias: int = 1024


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The HTTP server's settings (the engine's are :class:`~pyxllm.config.EngineConfig`).

    Attributes:
        host, port: where to listen.
        root_path: the path prefix a proxy serves the API under (``--root-path``, FastAPI's
            ``root_path``): routes answer with and without it, and the API docs use it.
        reasoning_parser: the parser splitting chat text into ``reasoning_content`` and
            ``content`` (a registered name), ``None`` for none.
        reasoning_budget: the ``thinking_token_budget`` of a chat request that sets none
            (``--reasoning-budget``, llama.cpp's flag; ``None``: unlimited); needs a
            ``reasoning_parser``.
        enable_auto_tool_choice: whether ``auto`` must be served (vLLM's flag): the server
            then fails at start-up when there is no parser, instead of refusing ``auto``.
        tool_call_parser: the parser of the model's own calls for ``tool_choice: "auto"``: a
            registered name, ``"auto"`` (chosen from the chat template, see
            :mod:`.chat.tool_parsers.auto`), or ``"none"``/``None``, which refuse ``auto``.
        ignore_unknown_fields: whether a request field pyxllm does not know is logged and
            ignored (vLLM's behaviour) rather than refused with a 400 naming it (OpenAI's).
        enable_prompt_tokens_details: whether ``usage`` carries ``prompt_tokens_details``
            (``cached_tokens``: the prompt tokens served from the prefix cache).
        trust_request_chat_template: whether a request may bring its own chat template.
        web_ui: whether ``GET /`` serves the chat page (:mod:`.web_ui`; ``--disable-web-ui``).
        enable_tokenizer_info_endpoint: whether ``GET /tokenizer_info`` answers (vLLM's flag;
            off by default: it shows the chat template).
        api_keys: the accepted ``Authorization: Bearer`` keys; empty: no key needed. Left out
            of ``repr`` so they never reach a log (see :mod:`.middleware.security`).
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
        stats_interval: seconds between the engine's stats lines in the log
            (:mod:`pyxllm.engine.stat_logger`); ``None`` logs none (``--disable-log-stats``).
        access_log: whether each HTTP request gets a log line (:mod:`.middleware.access_log`;
            ``--disable-uvicorn-access-log``).
        log_level: uvicorn's log level (``--uvicorn-log-level``; its own access log is off).
        enable_log_requests: whether each request gets a log line when it arrives and one when
            it finishes (:mod:`.middleware.request_logger`).
        max_log_len: the most characters (and token ids) of a prompt those lines show;
            ``None``: all.
        data_parallel_size: engine replicas behind this server (``--data-parallel-size``; 1:
            the engine runs in the server's process, see :mod:`pyxllm.engine.data_parallel`).
        dp_routing: how a request's replica is chosen (``--dp-routing``: ``cache_aware``,
            ``least_loaded`` or ``round_robin``).
        lora_modules: LoRA adapters loaded at start-up (``--lora-modules``), each ``{"name",
            "path", "base_model_name"}``; needs ``--enable-lora``.
        allow_runtime_lora_updating: whether ``POST /v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` answer (also vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    """

    host: str = flag("127.0.0.1", group=SERVER_FLAGS, help="address to listen on")
    port: int = flag(
        8000,
        type=port,
        metavar="PORT",
        group=SERVER_FLAGS,
        help="TCP port to listen on (bound before the model loads: a port in use fails at once)",
    )
    root_path: str = flag(
        "",
        metavar="PATH",
        group=SERVER_FLAGS,
        help="the path prefix a reverse proxy serves the API under (/api: routes answer at /v1 "
        "and /api/v1, the API docs point to /api/openapi.json) (default: none)",
    )
    reasoning_parser: str | None = flag(
        None,
        choices=reasoning_parser_choices,
        group=RESPONSE_FLAGS,
        help="split chat output into message.reasoning_content (the thinking) and content: "
        "qwen3 or deepseek_r1 (<think> tags), openai_gptoss or gpt_oss (gpt-oss's harmony), "
        "granite (Granite 3.2's thought-process phrases), auto (the one the chat template's "
        "markers name, else none)",
    )
    reasoning_budget: int | None = flag(
        None,
        type=int,
        flag_default=-1,
        to_field=lambda args: None if args.reasoning_budget < 0 else args.reasoning_budget,
        metavar="N",
        group=RESPONSE_FLAGS,
        help="the thinking_token_budget of a chat request that sets none, as llama.cpp's flag: "
        "after N reasoning tokens the end of the thinking (</think>) is forced; 0 closes it at "
        "once; -1: unlimited; needs --reasoning-parser (default: -1)",
    )
    enable_auto_tool_choice: bool = flag(
        False,
        group=RESPONSE_FLAGS,
        help='require tool_choice "auto" (the default with tools) to be served, as vLLM\'s flag: '
        "start-up fails when --tool-call-parser is none or auto finds no parser for the chat "
        'template (without it, "auto" is served whenever there is a parser)',
    )
    tool_call_parser: str | None = flag(
        AUTO,
        choices=lambda: [AUTO, NONE, *tool_parser_names()],
        group=RESPONSE_FLAGS,
        help='the format of the model\'s own tool calls (tool_choice "auto"): auto, chosen '
        "from the chat template (the start-up log says which and why); hermes (Qwen2.5/Qwen3's "
        "<tool_call> tags; also what a model whose template has no tools is asked to write); "
        "llama3_json (Llama 3.x); pythonic or llama4_pythonic (Llama 3.2/4's [f(a=1)]); mistral "
        "([TOOL_CALLS]); qwen3_coder (Qwen3-Coder's <function=...> XML); deepseek_v3 or "
        "deepseek_v31 (DeepSeek's tool-call tokens); granite (Granite 3's <|tool_call|>); "
        "phi4_mini_json (functools[...]); none: "
        '"auto" is refused (default: auto)',
    )
    ignore_unknown_fields: bool = flag(
        False,
        group=RESPONSE_FLAGS,
        help="log and ignore request fields pyxllm does not know (vLLM's behaviour, for clients "
        "that send vendor extras) instead of answering a 400 naming them (OpenAI's)",
    )
    enable_prompt_tokens_details: bool = flag(
        False,
        group=RESPONSE_FLAGS,
        help="add usage.prompt_tokens_details.cached_tokens (OpenAI's field: the prompt tokens "
        "served from the prefix cache) to chat and completion responses, streamed usage too",
    )
    trust_request_chat_template: bool = flag(
        False,
        group=RESPONSE_FLAGS,
        help="let a request bring its own chat template (chat_template, or chat_template_kwargs' "
        "chat_template); otherwise a 400",
    )
    web_ui: bool = flag(
        True,
        name="disable_web_ui",
        flag_default=False,
        to_field=lambda args: not args.disable_web_ui,
        group=SERVER_FLAGS,
        help="serve no chat page at / (nor its files at /static/)",
    )
    enable_tokenizer_info_endpoint: bool = flag(
        False,
        group=SERVER_FLAGS,
        help="answer GET /tokenizer_info (the tokenizer's configuration and chat template, as "
        "vLLM)",
    )
    api_keys: tuple[str, ...] = flag(
        (),
        repr=False,
        name="api_key",
        type=api_keys,
        action="append",
        flag_default=None,
        metavar="KEY",
        to_field=lambda args: args.api_keys,  # resolved with $PYXLLM_API_KEY by the command
        group=SECURITY_FLAGS,
        help="require `Authorization: Bearer KEY` on every route but /health, /version, the "
        "API docs, the chat page's files (/ and /static/*) and /metrics; repeat it or "
        "separate keys by commas for several; the "
        f"variable ${API_KEY_ENV} keeps keys out of ps (see docs/serving.md, Exposing the server) "
        f"(default: ${API_KEY_ENV}, comma-separated, else no key)",
    )
    protect_metrics: bool = flag(
        False, group=SECURITY_FLAGS, help="require the API key on /metrics too"
    )
    ssl_keyfile: str | None = flag(
        None,
        metavar="PATH",
        group=SECURITY_FLAGS,
        help="the server's TLS private key (PEM); needs --ssl-certfile",
    )
    ssl_certfile: str | None = flag(
        None,
        metavar="PATH",
        group=SECURITY_FLAGS,
        help="the server's TLS certificate chain (PEM): serve HTTPS",
    )
    ssl_ca_certs: str | None = flag(
        None,
        metavar="PATH",
        group=SECURITY_FLAGS,
        help="CA certificates (PEM) to check client certificates against",
    )
    ssl_cert_reqs: int = flag(
        0,
        type=int_value,
        flag_default=None,  # resolved by the command: 2 with --ssl-ca-certs, else 0
        choices=(0, 1, 2),
        group=SECURITY_FLAGS,
        help="client certificates: 0 not asked for, 1 optional, 2 required (Python's "
        "ssl.CERT_*) (default: 2 with --ssl-ca-certs, else 0)",
    )
    allowed_origins: tuple[str, ...] = flag(
        (),
        type=string_list,
        metavar="LIST",
        group=SECURITY_FLAGS,
        help="CORS: origins browsers may call from, a JSON list ('[\"https://a.example\"]', "
        '["*"] for any) or comma-separated (default: none, no CORS)',
    )
    allowed_methods: tuple[str, ...] = flag(
        ("*",),
        type=string_list,
        metavar="LIST",
        group=SECURITY_FLAGS,
        help="CORS: allowed methods, a JSON list or comma-separated",
    )
    allowed_headers: tuple[str, ...] = flag(
        ("*",),
        type=string_list,
        metavar="LIST",
        group=SECURITY_FLAGS,
        help="CORS: allowed request headers, a JSON list or comma-separated",
    )
    allow_credentials: bool = flag(
        False, group=SECURITY_FLAGS, help="CORS: allow credentials (cookies)"
    )
    limits: RequestLimits = nested(RequestLimits)
    max_waiting_requests: int = flag(
        256,
        type=int_value,
        metavar="N",
        group=LIMIT_FLAGS,
        help="requests that may wait beyond the --max-seqs-per-batch running ones; more get a "
        "503 with Retry-After",
    )
    shutdown_timeout: float = flag(
        10.0,
        type=float_value,
        metavar="SECONDS",
        group=LIMIT_FLAGS,
        help="on SIGTERM, how long running requests may finish before they are aborted",
    )
    stats_interval: float | None = flag(
        10.0,
        type=positive(float_value),
        metavar="SECONDS",
        to_field=lambda args: None if args.disable_log_stats else args.stats_interval,
        also=(
            Flag(
                name="disable_log_stats",
                flag_default=False,
                help="log no stats lines (vLLM's --disable-log-stats)",
            ),
        ),
        group=LOGGING_FLAGS,
        help="how often, while there is work, the log shows one line with prompt and generation "
        "tokens/s, running, waiting and preempted requests, KV cache usage and prefix cache hit "
        "rate (and with speculative decoding a line with the acceptance rates), as vLLM logs "
        "them",
    )
    access_log: bool = flag(
        True,
        name="disable_uvicorn_access_log",
        flag_default=False,
        to_field=lambda args: not args.disable_uvicorn_access_log,
        group=LOGGING_FLAGS,
        help="log no line per HTTP request (client, method, path, status, duration in ms; logger "
        "pyxllm.access, written when the response's last byte is sent, so a stream's line has "
        "the whole stream's time) (default: off, a line per request)",
    )
    log_level: str = flag(
        "warning",
        name="uvicorn_log_level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        group=LOGGING_FLAGS,
        help="uvicorn's own log level (pyxllm logs the start-up URL and the requests itself)",
    )
    enable_log_requests: bool = flag(
        False,
        group=LOGGING_FLAGS,
        help="log a line when a request arrives (id, prompt length, sampling parameters, prompt "
        "text) and one when it finishes (tokens, finish reason, time to first token, end to "
        "end), as vLLM's flag",
    )
    max_log_len: int | None = flag(
        None,
        type=optional(positive(int_value)),
        metavar="N",
        group=LOGGING_FLAGS,
        help="most characters of a prompt's text a --enable-log-requests line shows (default: all)",
    )
    data_parallel_size: int = flag(
        1,
        type=positive(int_value),
        aliases=("-dp",),
        metavar="N",
        group="parallel flags",
        help="run N engine replicas behind this server, each its own process with its own "
        "scheduler, KV cache (--kv-cache-memory each) and --tp ranks; on the CPU the cores are "
        "divided between them; with --distributed-executor-backend ray, actors placed on the Ray "
        "cluster (see docs/parallelism.md, Data parallelism)",
    )
    dp_routing: str = flag(
        "cache_aware",
        choices=ROUTING_POLICIES,
        group="parallel flags",
        help="which replica serves a request: cache_aware (the one whose prefix cache holds at "
        "least 30 %% of its prompt, else the least loaded), least_loaded (fewest running plus "
        "waiting requests) or round_robin",
    )
    lora_modules: tuple[dict, ...] = flag(
        (),
        type=lora_modules,
        action="extend",
        nargs="+",
        flag_default=None,
        metavar="NAME=PATH",
        to_field=lambda args: tuple(m for group in args.lora_modules or () for m in group),
        group="LoRA flags",
        help="LoRA adapters to serve from start-up (with --enable-lora), each a PEFT directory "
        "that requests name as their `model`: NAME=PATH pairs, separated by spaces (as vLLM's) "
        'or commas, or vLLM\'s JSON \'{"name": ..., "path": ..., "base_model_name": ...}\' (or '
        "a list of them); the flag may repeat",
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        group="LoRA flags",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the environment turns it on too)",
    )
