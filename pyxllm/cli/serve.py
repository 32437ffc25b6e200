"""``pyxllm serve``: the OpenAI-compatible server. Its flags are
:class:`~pyxllm.entrypoints.openai.server_options.ServerOptions`' and
:class:`~pyxllm.config.EngineConfig`'s fields."""

from __future__ import annotations

import argparse
import gc
import os

from pyxllm.cli.dataclass_args import add_dataclass_flags
from pyxllm.cli.security_args import check_security_args
from pyxllm.config import ENGINE_FLAG_GROUPS, EngineConfig
from pyxllm.entrypoints.openai.server_options import (
    RESPONSE_FLAGS,
    SERVER_FLAG_GROUPS,
    SERVER_FLAGS,
    ServerOptions,
)
from pyxllm.flag_fields import from_namespace
from pyxllm.weights.source import is_model_id


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``serve`` parser: the positional MODEL, then the server's and the engine's flags."""
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        allow_abbrev=False,
        formatter_class=formatter,
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
    return serve


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The checks of several serve flags together, before the model loads: MODEL against
    ``--model``, the security flags, the limits, data parallelism against ``--nnodes``; a
    failure is ``parser``'s usage error."""
    if args.model_tag is not None:
        if not (os.path.exists(os.path.expanduser(args.model_tag)) or is_model_id(args.model_tag)):
            parser.error(
                f"MODEL {args.model_tag!r}: neither a path that exists nor a Hugging Face "
                "model id ORG/NAME"
            )
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r}: give one of them")
        args.model = args.model_tag
    check_security_args(args, parser)
    if args.max_waiting_requests < 0:
        parser.error("--max-waiting-requests: must be >= 0")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout: must be >= 0")
    lora_modules = [m for group in args.lora_modules or () for m in group]
    if lora_modules and not args.enable_lora:
        parser.error("--lora-modules: needs --enable-lora")
    if args.allow_runtime_lora_updating and not args.enable_lora:
        parser.error("--allow-runtime-lora-updating: needs --enable-lora")
    if args.enable_lora and args.data_parallel_size > 1:
        parser.error(
            "--enable-lora: not with --data-parallel-size > 1 (one engine serves adapters)"
        )
    if args.kv_transfer_listen is not None and args.data_parallel_size > 1:
        parser.error("--kv-transfer-listen: not with --data-parallel-size > 1 (one port each)")
    names = [m["name"] for m in lora_modules]
    if len(set(names)) != len(names):
        parser.error(f"--lora-modules: names must differ, got {', '.join(names)}")
    if args.data_parallel_size > 1 and args.nnodes > 1:
        parser.error(
            "--data-parallel-size: cannot be combined with --nnodes (tensor parallelism "
            "over nodes started by hand); to place replicas on several nodes, use "
            "--distributed-executor-backend ray"
        )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the OpenAI-compatible server until interrupted; 0 when it stops."""
    # here, not at the top: pyxllm --help loads no torch or fastapi
    from pyxllm.entrypoints.openai.api_server import run_server

    run_server(config, from_namespace(ServerOptions, args))
    # The engine is shut down; what is left is freed as the process exits. Frozen, the
    # interpreter's final garbage collection skips it (it took ~3 s of the server's exit).
    gc.freeze()
    return 0
