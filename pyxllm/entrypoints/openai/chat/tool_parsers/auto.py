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
    in a system message (:func:`~pyxllm.entrypoints.openai.chat.tools.tools_system_text`)."""
    return isinstance(chat_template, str) and "tools" in chat_template


def choose_tool_parser(chat_template: str | None) -> ToolParserChoice:
    """The parser of the calls a model whose chat template is ``chat_template`` writes.

    The rules, the first that matches wins, each read from the template's text:

    1. No template, or one that never names ``tools`` (the embedded SmolLM2's): pyxllm offers
       the tools itself, in a system message that asks for Hermes blocks (``<tool_call>{"name":
       ..., "arguments": ...}</tool_call>``): ``hermes``.
    2. ``<tool_call>`` and ``<function=``: calls written as XML inside the tags (Qwen3-Coder's
       template shows ``<function=example_function_name>`` and ``<parameter=...>``):
       ``qwen3_coder``.
    3. ``<tool_call>``: Hermes' JSON calls (Qwen2, Qwen2.5, Qwen3, Hermes 2/3, SmolLM3):
       ``hermes``.
    4. ``<｜tool▁calls▁begin｜>``: DeepSeek's call tokens (the V3, R1 and V3.1 templates write
       an assistant's calls between them): ``deepseek_v3``, which reads V3.1's form too.
    5. ``<|tool_call|>``: Granite 3's call token (its templates write an assistant's calls as
       ``<|tool_call|>`` and a JSON array; Granite 4's ``<tool_call>`` tags are rule 3's):
       ``granite``.
    6. ``[TOOL_CALLS]``: Mistral's call token (its templates write an assistant's calls after
       it, as a JSON array or as ``name[ARGS]{...}``): ``mistral``.
    7. ``[func_name1(``: the call format vLLM's pythonic templates (Llama 3.2, Llama 4, Gemma 3,
       ToolACE) describe, ``[func_name1(params_name1=params_value1, ...), func_name2(params)]``:
       ``pythonic``.
    8. ``functools[``: the call format vLLM's Phi-4-mini template describes (a JSON list of
       ``{"name", "arguments"}`` after the word ``functools``): ``phi4_mini_json``.
    9. Llama 3's ``<|start_header_id|>`` with ``<|python_tag|>`` or a ``"parameters"`` key (the
       JSON call format Llama 3.1-3.3's templates describe and render): ``llama3_json``.
    10. ``<|channel|>`` and ``<|call|>``: OpenAI's harmony format (gpt-oss's template writes
        an assistant's call as ``<|start|>assistant to=functions.NAME<|channel|>commentary
        json<|message|>{...}<|call|>``): ``openai``.
    11. Anything else that renders tools (InternLM's, Kimi's ...): none;
        ``--tool-call-parser NAME`` picks one by hand.
    """
    if not template_renders_tools(chat_template):
        return ToolParserChoice(
            "hermes",
            "the chat template does not render tools, so they are offered in a system message "
            "that asks for <tool_call> blocks",
        )
    if "<tool_call>" in chat_template and "<function=" in chat_template:
        return ToolParserChoice(
            "qwen3_coder",
            "the chat template writes calls as <function=...> XML inside <tool_call> tags",
        )
    if "<tool_call>" in chat_template:
        return ToolParserChoice(
            "hermes", "the chat template renders tools and writes calls in <tool_call> tags"
        )
    if "<｜tool▁calls▁begin｜>" in chat_template:
        return ToolParserChoice(
            "deepseek_v3", "the chat template writes calls between DeepSeek's tool-call tokens"
        )
    if "<|tool_call|>" in chat_template:
        return ToolParserChoice(
            "granite", "the chat template writes calls as a JSON array after <|tool_call|>"
        )
    if "[TOOL_CALLS]" in chat_template:
        return ToolParserChoice(
            "mistral", "the chat template writes calls after Mistral's [TOOL_CALLS] token"
        )
    if "[func_name1(" in chat_template:
        return ToolParserChoice(
            "pythonic",
            "the chat template asks for calls as a Python list, [func_name1(params_name1="
            "params_value1, ...)]",
        )
    if "functools[" in chat_template:
        return ToolParserChoice(
            "phi4_mini_json",
            'the chat template asks for calls as functools[{"name": ..., "arguments": ...}]',
        )
    if "<|start_header_id|>" in chat_template and (
        "<|python_tag|>" in chat_template or '"parameters"' in chat_template
    ):
        return ToolParserChoice(
            "llama3_json",
            'the chat template is Llama 3\'s and writes calls as {"name": ..., "parameters": '
            "...} JSON",
        )
    if "<|channel|>" in chat_template and "<|call|>" in chat_template:
        return ToolParserChoice(
            "openai",
            "the chat template is OpenAI's harmony format and writes calls as commentary "
            "messages to=functions.NAME ending in <|call|>",
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
