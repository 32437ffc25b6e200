"""Which parser reads a model's own tool calls (``tool_choice: "auto"``), chosen from its chat
template: ``--tool-call-parser auto``, the default, so that tools work on a server started with
no tool flags (as llama.cpp's server does); ``--tool-call-parser none`` serves no ``auto``.

The start-up log says which parser was chosen and why (:attr:`ToolParserChoice.reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The values of --tool-call-parser besides the registered parsers' names.
AUTO, NONE = "auto", "none"


@dataclass(frozen=True, slots=True)
class ToolParserChoice:
    """The parser of ``tool_choice: "auto"``: its registered ``name`` (``None``: ``auto`` is
    refused with a 400 naming ``tool_choice``) and the ``reason``, one sentence for the
    start-up log and for that 400."""

    name: str | None
    reason: str


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the chat template takes ``tools=`` (it names ``tools``); another gets the tools
    in a system message (:func:`~pyxllm.entrypoints.openai.tools.tools_system_text`)."""
    return isinstance(chat_template, str) and "tools" in chat_template


def choose_tool_parser(chat_template: str | None) -> ToolParserChoice:
    """The parser of the calls a model whose chat template is ``chat_template`` writes.

    The rules, the first that matches wins, each read from the template's text:

    1. No template, or one that never names ``tools`` (the embedded SmolLM2's): pyxllm offers
       the tools itself, in a system message that asks for Hermes blocks (``<tool_call>{"name":
       ..., "arguments": ...}</tool_call>``): ``hermes``.
    2. ``<tool_call>`` and ``<function=``: calls written as XML inside the tags (Qwen3-Coder's),
       which no registered parser reads: none.
    3. ``<tool_call>``: Hermes' JSON calls (Qwen2, Qwen2.5, Qwen3, Hermes 2/3, SmolLM3):
       ``hermes``.
    4. Llama 3's ``<|start_header_id|>`` with ``<|python_tag|>`` or a ``"parameters"`` key (the
       JSON call format Llama 3.1-3.3's templates describe and render): ``llama3_json``.
    5. Anything else that renders tools (Mistral's ``[TOOL_CALLS]``, DeepSeek's, Granite's ...):
       none; ``--tool-call-parser NAME`` picks one by hand.
    """
    if not template_renders_tools(chat_template):
        return ToolParserChoice(
            "hermes",
            "the chat template does not render tools, so they are offered in a system message "
            "that asks for <tool_call> blocks",
        )
    if "<tool_call>" in chat_template and "<function=" in chat_template:
        return ToolParserChoice(
            None,
            "the chat template writes calls as <function=...> XML inside <tool_call> tags, "
            "which no tool-call parser reads",
        )
    if "<tool_call>" in chat_template:
        return ToolParserChoice(
            "hermes", "the chat template renders tools and writes calls in <tool_call> tags"
        )
    if "<|start_header_id|>" in chat_template and (
        "<|python_tag|>" in chat_template or '"parameters"' in chat_template
    ):
        return ToolParserChoice(
            "llama3_json",
            'the chat template is Llama 3\'s and writes calls as {"name": ..., "parameters": '
            "...} JSON",
        )
    return ToolParserChoice(
        None, "the chat template renders tools in a call format no tool-call parser reads"
    )


def resolve_tool_parser(flag: str | None, chat_template: str | None) -> ToolParserChoice:
    """The parser ``--tool-call-parser flag`` gives a model with ``chat_template``: ``auto``
    chooses (:func:`choose_tool_parser`), ``none`` or ``None`` refuses ``auto``, a parser's
    name is that parser."""
    if flag == AUTO:
        return choose_tool_parser(chat_template)
    if flag in (None, NONE):
        return ToolParserChoice(None, "the server was started with --tool-call-parser none")
    return ToolParserChoice(flag, f"--tool-call-parser {flag}")
