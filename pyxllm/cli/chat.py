"""``pyxllm chat``: a terminal chat with an OpenAI-compatible server
(:mod:`pyxllm.entrypoints.chat_cli`)."""

from __future__ import annotations

import argparse

from pyxllm.cli.sampling import check_sampling_args
from pyxllm.config import EngineConfig
from pyxllm.entrypoints.chat_args import add_chat_args


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``chat`` parser."""
    chat = commands.add_parser(
        "chat",
        help="chat in the terminal with an OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Chat in the terminal with an OpenAI-compatible server (as vllm chat): "
        "replies stream, the conversation is kept, /reset starts over, Ctrl-D quits.",
    )
    add_chat_args(chat)
    return chat


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Bad sampling flag values fail before the chat starts (``parser``'s usage error)."""
    check_sampling_args(args, parser)


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Chat until Ctrl-D; the chat's exit status."""
    # here, not at the top: pyxllm --help loads no openai
    from pyxllm.entrypoints.chat_cli import run_chat

    return run_chat(args)
