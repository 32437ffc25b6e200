"""Converters of flag text to values, as :attr:`pyxllm.flag_fields.Flag.type` and the parsers
use them; each raises ``ValueError`` or ``argparse.ArgumentTypeError``, which argparse reports
as a usage error naming the flag.

A leaf module (it imports nothing of pyxllm).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any


def int_value(text: str) -> int:
    """An integer."""
    return int(text)


def float_value(text: str) -> float:
    """A finite float (``nan`` and ``inf`` are refused)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


int_value.__name__, float_value.__name__ = "int", "float"  # argparse's "invalid int value"


def optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A converter that also reads ``none``/``auto`` as ``None`` (for ``int | None`` fields)."""

    def parse(text: str):
        return None if text.strip().lower() in ("none", "auto") else convert(text)

    parse.__name__ = convert.__name__
    return parse


def human_readable_int(text: str) -> int:
    """An integer, or one with vLLM's suffixes: ``k``, ``m``, ``g``, ``t`` powers of 1000
    (``25.6k`` = 25600), ``K``, ``M``, ``G``, ``T`` powers of 1024 (``4G``, no decimals)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise ValueError(text)
    number, suffix = match.groups()
    if suffix and suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals go with the decimal suffixes k, m, g, t only"
        )
    return int(number) * (1024 ** ("KMGT".index(suffix) + 1) if suffix else 1)


human_readable_int.__name__ = "int"
