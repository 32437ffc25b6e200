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
import difflib
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
    for command_parser in _every_parser(parser):
        usage = compact_usage(command_parser)
        if usage is not None:
            command_parser.usage = usage
    return parser


# an automatic usage longer than this many lines is replaced by compact_usage's one line
MAX_USAGE_LINES = 8


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser``'s subcommands' parsers, theirs included (``bench serve``), not ``parser``."""
    sub = _subcommands(parser)
    if sub is None:
        return []
    nested = list(dict.fromkeys(sub.choices.values()))  # aliases share a parser
    return nested + [p for child in nested for p in _every_parser(child)]


def compact_usage(parser: argparse.ArgumentParser) -> str | None:
    """One usage line for a parser whose automatic one lists every flag over more than
    :data:`MAX_USAGE_LINES` lines (``serve``'s took 70, and a usage error printed it all):
    its positionals and required flags, then ``[flags]`` (``--help`` lists them); ``None``
    when the automatic usage is short enough (vLLM's ``vllm serve [model_tag] [options]``)."""
    if parser.format_usage().count("\n") <= MAX_USAGE_LINES:
        return None
    words = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        metavar = action.metavar or action.dest.upper()
        if not action.option_strings:
            words.append(f"[{metavar}]" if action.nargs in ("?", "*") else metavar)
        elif action.required:
            words.append(f"{action.option_strings[0]} {metavar}")
    return " ".join([parser.prog, *words, "[flags]"])


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The innermost parser ``args`` went through (``bench``'s ``latency`` for ``pyxllm bench
    latency ...``)."""
    sub = _subcommands(parser)
    while sub is not None:
        parser = sub.choices[getattr(args, sub.dest)]
        sub = _subcommands(parser)
    return parser


def unrecognized_message(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" message for ``extra``, with the closest flag of
    ``parser`` for each misspelt one (``--prot``: did you mean ``--port``?)."""
    flags = [s for action in parser._actions for s in action.option_strings]
    hints = []
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.7)
            hints += [f"{word.split('=', 1)[0]}: did you mean {close[0]}?"] if close else []
    return f"unrecognized arguments: {' '.join(extra)}" + (
        f" ({'; '.join(hints)})" if hints else ""
    )


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
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser, not the top one (argparse's default)
        chosen = _chosen_parser(parser, args)
        chosen.error(unrecognized_message(chosen, extra))
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
