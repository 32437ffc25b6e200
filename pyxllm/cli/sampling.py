"""The sampling flags ``generate`` and ``chat`` check before anything loads."""

from __future__ import annotations

import argparse

from pyxllm.sampling_params import SamplingParams


def _flag_error(message: str) -> str:
    """Turn a ``SamplingParams`` message (``"top_p: must be ..."``) into one naming the flag."""
    name, sep, rest = message.partition(":")
    if sep and name.isidentifier():
        return f"--{name.replace('_', '-')}:{rest}"
    return message


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` of the ``--max-tokens``, ``--temperature`` and ``--top-p`` flags.

    Raises:
        ValueError: a value out of range, naming the field.
    """
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )


def check_sampling_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A bad sampling flag value exits with ``parser``'s usage error naming the flag."""
    try:
        sampling_params(args)
    except ValueError as exc:
        parser.error(_flag_error(str(exc)))
