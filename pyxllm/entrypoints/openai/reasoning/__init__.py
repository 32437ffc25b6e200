"""Reasoning parsers: split a chat completion's text into ``reasoning_content`` and ``content``.

``pyxllm serve --reasoning-parser NAME`` picks one by name. The registry maps names to
``(module, class)`` strings, so listing the names (for ``--help`` and flag checks) imports
nothing.
"""

from __future__ import annotations

import importlib

from pyxllm.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningSpans

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSpans",
    "get_reasoning_parser",
    "reasoning_parser_names",
]

# name -> (module, class). DeepSeek-R1 uses the same <think>...</think> convention as Qwen3.
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("pyxllm.entrypoints.openai.reasoning.think_tags", "ThinkTagReasoningParser"),
    "deepseek_r1": ("pyxllm.entrypoints.openai.reasoning.think_tags", "ThinkTagReasoningParser"),
}


def reasoning_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    try:
        module_name, class_name = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser: unknown parser {name!r}; known parsers: "
            f"{', '.join(reasoning_parser_names())}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
