"""Tool parsers: find the calls in a chat completion's text (``tool_choice: "auto"``).

``pyxllm serve --tool-call-parser NAME`` picks one by name, as in vLLM, and ``auto`` (the
default) from the chat template (:mod:`.auto`); the registry (a
:class:`~..registry.LazyRegistry`) imports a parser only when it is chosen.
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.tool_parsers.base import (
    ParsedToolOutput,
    ToolCallState,
    ToolCallStream,
    ToolParser,
    split_tool_calls,
    tool_calls_of,
)
from pyxllm.entrypoints.openai.registry import LazyRegistry

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

TOOL_PARSERS = LazyRegistry(
    "--tool-call-parser",
    {
        "deepseek_v3": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.deepseek_v3",
            "DeepSeekV3ToolParser",
        ),
        "deepseek_v31": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.deepseek_v3",
            "DeepSeekV3ToolParser",
        ),
        "granite": ("pyxllm.entrypoints.openai.chat.tool_parsers.granite", "GraniteToolParser"),
        "hermes": ("pyxllm.entrypoints.openai.chat.tool_parsers.hermes", "HermesToolParser"),
        "llama3_json": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.llama3_json",
            "Llama3JsonToolParser",
        ),
        "llama4_pythonic": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.pythonic",
            "PythonicToolParser",
        ),
        "mistral": ("pyxllm.entrypoints.openai.chat.tool_parsers.mistral", "MistralToolParser"),
        "openai": ("pyxllm.entrypoints.openai.chat.tool_parsers.gpt_oss", "OpenAIToolParser"),
        "phi4_mini_json": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.phi4_mini",
            "Phi4MiniToolParser",
        ),
        "pythonic": ("pyxllm.entrypoints.openai.chat.tool_parsers.pythonic", "PythonicToolParser"),
        "qwen3_coder": (
            "pyxllm.entrypoints.openai.chat.tool_parsers.qwen3_coder",
            "Qwen3CoderToolParser",
        ),
    },
)


def tool_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return TOOL_PARSERS.names()


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name`` (ValueError for an unknown one, listing them)."""
    return TOOL_PARSERS.get(name)
