"""Tool parsers: find the calls in a chat completion's text (``tool_choice: "auto"``).

``pyxllm serve --enable-auto-tool-choice --tool-call-parser NAME`` picks one by name, as in
vLLM; the registry maps names to ``(module, class)`` strings, so listing them imports nothing.
"""

from __future__ import annotations

import importlib

from pyxllm.entrypoints.openai.tool_parsers.base import (
    ParsedToolOutput,
    ToolCallState,
    ToolCallStream,
    ToolParser,
    split_tool_calls,
    tool_calls_of,
)

__all__ = [
    "TOOL_PARSERS",
    "ParsedToolOutput",
    "ToolCallState",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "split_tool_calls",
    "tool_calls_of",
    "tool_parser_names",
]

TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("pyxllm.entrypoints.openai.tool_parsers.hermes", "HermesToolParser"),
    "llama3_json": ("pyxllm.entrypoints.openai.tool_parsers.llama3_json", "Llama3JsonToolParser"),
}


def tool_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    try:
        module_name, class_name = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--tool-call-parser: unknown parser {name!r}; known parsers: "
            f"{', '.join(tool_parser_names())}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
