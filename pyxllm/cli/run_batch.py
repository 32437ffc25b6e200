"""``pyxllm run-batch``: a file of OpenAI batch requests answered offline by the server's own
routes (:mod:`pyxllm.entrypoints.openai.run_batch`)."""

from __future__ import annotations

import argparse
import os

from pyxllm.cli.dataclass_args import add_dataclass_flags
from pyxllm.cli.engine_args import add_engine_args
from pyxllm.config import EngineConfig
from pyxllm.entrypoints.openai.server_options import RESPONSE_FLAGS, ServerOptions
from pyxllm.entrypoints.run_batch_args import add_run_batch_args


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``run-batch`` parser: its own flags, then ``serve``'s response and engine flags."""
    run_batch = commands.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests offline, as the server would",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Answer a JSONL file of requests in OpenAI's batch format (chat "
        "completions, completions, embeddings) with the server's own routes, in this process "
        "(no port), several at once; each result line is appended as it finishes, and a rerun "
        "skips the custom_ids already answered (as vllm run-batch).",
    )
    add_run_batch_args(run_batch.add_argument_group("batch flags"))
    add_dataclass_flags(run_batch, [ServerOptions], include=[RESPONSE_FLAGS])
    add_engine_args(run_batch)
    return run_batch


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit with a usage error naming the flag when the input file or the output's directory
    is not there (before the model loads; ``-`` is standard input or output)."""
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        parser.error(f"--input-file {args.input_file}: no such file")
    directory = os.path.dirname(os.path.abspath(args.output_file))
    if args.output_file != "-" and not os.path.isdir(directory):
        parser.error(f"--output-file {args.output_file}: no directory {directory}")


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Answer the file (see :func:`~pyxllm.entrypoints.openai.run_batch.run_batch_command`)."""
    # here, not at the top: pyxllm --help loads no torch or fastapi
    from pyxllm.entrypoints.openai.run_batch import run_batch_command

    return run_batch_command(args, config)
