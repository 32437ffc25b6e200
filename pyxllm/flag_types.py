"""Converters of flag text to values, as :attr:`pyxllm.flag_fields.Flag.type` and the parsers
use them; each raises ``ValueError`` or ``argparse.ArgumentTypeError``, which argparse reports
as a usage error naming the flag.

A leaf module (it imports nothing of pyxllm).
"""

from __future__ import annotations

import argparse
import json
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


def positive(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert`` (:func:`int_value` or :func:`float_value`) refusing values <= 0."""

    def parse(text: str):
        value = convert(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

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


def port(text: str) -> int:
    """A TCP port, an integer in 0..65535."""
    value = int(text) if text.strip().isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: must be an integer in 0..65535")
    return value


def string_list(text: str) -> list[str]:
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


string_list.__name__ = "_string_list"


def api_keys(text: str) -> list[str]:
    """Comma-separated API keys; an error never echoes them."""
    keys = [key.strip() for key in text.split(",")]
    if not all(keys):
        raise argparse.ArgumentTypeError("an API key cannot be empty")
    return keys


api_keys.__name__ = "_api_keys"


def lora_modules(text: str) -> list[dict]:
    """vLLM's ``--lora-modules`` value: ``name=path`` pairs (comma-separated), or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` or a list of them; each as such a
    dict (``base_model_name`` ``None`` when not given)."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
        items = items if isinstance(items, list) else [items]
        modules = []
        for item in items:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("path"), str)
            ):
                raise argparse.ArgumentTypeError(
                    f"{text!r}: each adapter is an object with string name and path"
                )
            modules.append(
                {
                    "name": item["name"],
                    "path": item["path"],
                    "base_model_name": item.get("base_model_name"),
                }
            )
        return modules
    modules = []
    for pair in stripped.split(","):
        name, sep, path = pair.strip().partition("=")
        if not (sep and name.strip() and path.strip()):
            raise argparse.ArgumentTypeError(f"{pair!r} is not NAME=PATH")
        modules.append({"name": name.strip(), "path": path.strip(), "base_model_name": None})
    return modules
