"""The ``pyxllm`` command: ``serve``, ``generate``, ``run-batch``, ``check-device``, ``bench``
(serve|eval|perplexity|throughput|latency), ``env``, ``chat`` and ``disagg-proxy``, each a module of
:mod:`pyxllm.cli`.

A bad flag value exits with argparse's usage error (status 2); an error while loading the model
(a ``ValueError`` or a missing file) prints ``error: <message>`` and exits with status 2
instead of a traceback (set ``PYXLLM_DEBUG=1`` to see the traceback).

Tensor parallelism by hand: ``serve`` (or ``generate``) with ``--node-rank i > 0`` runs only
that rank's executor (no HTTP server) until rank 0 stops it. A rank that cannot join the others,
or a server stopped by a dead worker, prints ``error: <message naming the rank>`` and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pyxllm.cli import bench, chat, check_device, disagg_proxy, env, generate, run_batch, serve
from pyxllm.cli.engine_args import config_from_args, engine_flags_help
from pyxllm.config import EngineConfig
from pyxllm.distributed.errors import DistributedError
from pyxllm.entrypoints.flags import HelpFormatter
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import NONE

# the subcommands, in --help's order
COMMANDS = {
    "serve": serve,
    "generate": generate,
    "check-device": check_device,
    "bench": bench,
    "run-batch": run_batch,
    "env": env,
    "chat": chat,
    "disagg-proxy": disagg_proxy,
}


def make_arg_parser() -> argparse.ArgumentParser:
    """The ``pyxllm`` parser with a subparser per :data:`COMMANDS` entry.

    ``args.command`` names the subcommand; ``parser.command_parsers[name]`` is its parser
    (for ``.error()`` after parsing).
    """
    parser = argparse.ArgumentParser(
        prog="pyxllm",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="pyxllm: a Python-native LLM inference and serving engine.",
        epilog=engine_flags_help(),
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.command_parsers = {
        name: module.add_parser(commands, HelpFormatter) for name, module in COMMANDS.items()
    }
    return parser


def _check_response_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The response flags of ``serve`` and ``run-batch`` checked together."""
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser == NONE:
        parser.error("--enable-auto-tool-choice: cannot be combined with --tool-call-parser none")
    budget = getattr(args, "reasoning_budget", -1)
    if budget < -1:
        parser.error(f"--reasoning-budget: must be -1 (unlimited) or >= 0, got {budget}")
    if budget >= 0 and args.reasoning_parser is None:
        parser.error(
            "--reasoning-budget: needs --reasoning-parser (the end of the thinking to force)"
        )


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse ``argv`` and build the config; a bad value exits with the subcommand's usage error."""
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    command_parser = parser.command_parsers[args.command]
    _check_response_args(args, command_parser)
    check = getattr(COMMANDS[args.command], "check", None)
    if check is not None:
        check(args, command_parser)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        command_parser.error(str(exc))
    return args, config


def run_worker_rank(config: EngineConfig) -> int:
    """A node with ``--node-rank`` > 0: be that TP rank until rank 0 stops it (status 0) or
    goes away (status 1)."""
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.executor.worker import run_worker

    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s rank {config.node_rank} %(name)s: %(message)s"
    )
    return run_worker(config, config.node_rank, config.world_size, config.master_addr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyxllm`` console script; returns the exit status."""
    args, config = parse_args(argv)
    try:
        if config.node_rank > 0 and args.command in ("serve", "generate", "run-batch"):
            return run_worker_rank(config)
        return COMMANDS[args.command].run(args, config)
    except KeyboardInterrupt:
        return 130
    except DistributedError as exc:
        if os.environ.get("PYXLLM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("PYXLLM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
