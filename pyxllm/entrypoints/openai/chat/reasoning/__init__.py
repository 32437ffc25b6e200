"""Reasoning parsers: split a chat completion's text into ``reasoning_content`` and ``content``.

``pyxllm serve --reasoning-parser NAME`` picks one by name, or ``auto`` by the chat template's
markers; the registry (a :class:`~..registry.LazyRegistry`) imports a parser only when it is
chosen.
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.chat.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSpans,
)
from pyxllm.entrypoints.openai.registry import LazyRegistry

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSpans",
    "check_reasoning_parser",
    "get_reasoning_parser",
    "reasoning_parser_choices",
    "reasoning_parser_for",
    "reasoning_parser_names",
    "resolve_reasoning_parser",
]

# DeepSeek-R1 uses the same <think>...</think> convention as Qwen3; gpt-oss's harmony
# reasoning is registered under vLLM's name and as gpt_oss.
REASONING_PARSERS = LazyRegistry(
    "--reasoning-parser",
    {
        "gpt_oss": ("pyxllm.entrypoints.openai.chat.reasoning.gpt_oss", "GptOssReasoningParser"),
        "openai_gptoss": (
            "pyxllm.entrypoints.openai.chat.reasoning.gpt_oss",
            "GptOssReasoningParser",
        ),
        "qwen3": ("pyxllm.entrypoints.openai.chat.reasoning.think_tags", "ThinkTagReasoningParser"),
        "deepseek_r1": (
            "pyxllm.entrypoints.openai.chat.reasoning.think_tags",
            "ThinkTagReasoningParser",
        ),
        "granite": ("pyxllm.entrypoints.openai.chat.reasoning.granite", "GraniteReasoningParser"),
    },
)
# --reasoning-parser auto: the parser the chat template's markers name
AUTO = "auto"


def reasoning_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return REASONING_PARSERS.names()


def reasoning_parser_choices() -> list[str]:
    """What ``--reasoning-parser`` takes: ``auto`` and the registered names."""
    return [AUTO, *reasoning_parser_names()]


def choose_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own markers call for: gpt-oss's harmony channels
    (``<|channel|>``), ``<think>`` tags (Qwen3, DeepSeek-R1), Granite's "thought process"
    phrases; ``None`` when it has none of them."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "gpt_oss"
    if "<think>" in template or "</think>" in template:
        return "qwen3"
    if "thought process" in template:
        return "granite"
    return None


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser ``--reasoning-parser name`` gives a model with ``chat_template``: ``auto``
    chooses (:func:`choose_reasoning_parser`), anything else is itself."""
    return choose_reasoning_parser(chat_template) if name == AUTO else name


def reasoning_parser_for(name: str | None, tokenizer) -> tuple[str | None, ReasoningParser | None]:
    """The parser ``--reasoning-parser name`` gives a model whose tokenizer is ``tokenizer``
    (pyxllm's ``Tokenizer``; ``auto`` reads its chat template): ``(resolved name, the parser
    built on the tokenizer)``, both ``None`` for none.

    Raises:
        ValueError: an unknown name (listing the known ones).
    """
    if name is None:  # the tokenizer is not read
        return None, None
    template = getattr(tokenizer.hf, "chat_template", None)
    resolved = resolve_reasoning_parser(name, template)
    return resolved, (get_reasoning_parser(resolved)(tokenizer) if resolved else None)


def check_reasoning_parser(name: str | None) -> None:
    """Fail early on a ``--reasoning-parser`` that is neither ``None``, ``auto`` nor registered
    (ValueError listing the known ones)."""
    if name not in (None, AUTO):
        get_reasoning_parser(name)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name`` (ValueError for an unknown one, listing them)."""
    return REASONING_PARSERS.get(name)
