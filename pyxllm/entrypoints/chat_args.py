"""The flags of ``pyxllm chat`` (:mod:`pyxllm.entrypoints.chat_cli`), apart from the chat
itself: the command line builds every subcommand's parser, and the chat's client (``openai``)
takes half a second to import."""

from __future__ import annotations

import argparse

from pyxllm.entrypoints.flags import flag_names

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
API_KEY_ENV = "OPENAI_API_KEY"


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pyxllm chat`` (vLLM's spellings ``--url``, ``--model-name`` and
    ``--system-prompt`` too)."""
    parser.add_argument(
        *flag_names("base_url"),
        "--url",
        dest="base_url",
        default=DEFAULT_BASE_URL,
        metavar="URL",
        help="the server's OpenAI API root (ends in /v1)",
    )
    parser.add_argument(
        "--model",
        *flag_names("model_name"),
        dest="model",
        default=None,
        metavar="NAME",
        help="the model to chat with (default: the first of GET /models)",
    )
    parser.add_argument(
        "--system",
        *flag_names("system_prompt"),
        dest="system",
        default=None,
        metavar="TEXT",
        help="a system message at the start of the conversation",
    )
    parser.add_argument(
        *flag_names("api_key"),
        dest="api_key",
        default=None,
        metavar="KEY",
        help=f"the server's API key (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "-q",
        "--quick",
        default=None,
        metavar="MESSAGE",
        help="send MESSAGE, print the reply and exit",
    )
    sampling = parser.add_argument_group("sampling flags (default: the server's)")
    sampling.add_argument(
        *flag_names("temperature"),
        dest="temperature",
        type=float,
        default=None,
        metavar="T",
        help="sampling temperature; 0 is greedy",
    )
    sampling.add_argument(
        *flag_names("top_p"),
        dest="top_p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling probability mass, in (0, 1]",
    )
    sampling.add_argument(
        *flag_names("max_tokens"),
        dest="max_tokens",
        type=int,
        default=None,
        metavar="N",
        help="most tokens of each reply",
    )
