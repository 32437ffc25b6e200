"""Reasoning parsers: split a chat completion's text into ``reasoning_content`` and ``content``.

``pyxllm serve --reasoning-parser NAME`` picks one by name; the registry (a
:class:`~..registry.LazyRegistry`) imports a parser only when it is chosen.
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningSpans
from pyxllm.entrypoints.openai.registry import LazyRegistry

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSpans",
    "get_reasoning_parser",
    "reasoning_parser_names",
]

# DeepSeek-R1 uses the same <think>...</think> convention as Qwen3; gpt-oss's harmony
# reasoning is registered under vLLM's name and as gpt_oss.
REASONING_PARSERS = LazyRegistry(
    "--reasoning-parser",
    {
        "gpt_oss": ("pyxllm.entrypoints.openai.reasoning.gpt_oss", "GptOssReasoningParser"),
        "openai_gptoss": (
            "pyxllm.entrypoints.openai.reasoning.gpt_oss",
            "GptOssReasoningParser",
        ),
        "qwen3": ("pyxllm.entrypoints.openai.reasoning.think_tags", "ThinkTagReasoningParser"),
        "deepseek_r1": (
            "pyxllm.entrypoints.openai.reasoning.think_tags",
            "ThinkTagReasoningParser",
        ),
    },
)


def reasoning_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return REASONING_PARSERS.names()


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name`` (ValueError for an unknown one, listing them)."""
    return REASONING_PARSERS.get(name)
