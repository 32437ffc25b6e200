"""Pydantic models of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``), field for field as far as pyxllm serves them.

Requests refuse fields they do not know, top-level or in a nested object of fixed keys
(``tool_choice.foo``), as the OpenAI models do (``--ignore-unknown-fields`` drops them); tools
stay open (a server tool's own keys must not hide that its type is refused); the fields
declared but not served are refused by :func:`~.messages_input.check_supported`
(400 naming them). Request content blocks are one permissive model (:class:`ContentBlockParam`)
so that a block pyxllm does not serve (an image) is refused by name rather than failing a
union's validation; responses and stream events are Anthropic's shapes exactly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from pyxllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    RequestModel,
    RequestObject,
)

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# --- requests -------------------------------------------------------------------------------


class ContentBlockParam(OpenAIBaseModel):
    """One block of a message's ``content``: ``text``, ``tool_use`` (an assistant's call),
    ``tool_result`` (a user's answer to one, its ``content`` a text or text blocks),
    ``thinking`` (an assistant's earlier reasoning), ``image`` (a user's, for a vision-language
    model), or a type pyxllm refuses by name (``document`` ...). ``cache_control`` is accepted
    on any: the prefix cache keeps every prompt's blocks without being asked."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None
    # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    source: dict[str, Any] | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class MessageParam(RequestObject):
    """One turn of ``messages``: a text, or content blocks (``system`` turns: text only)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class TextBlockParam(RequestObject):
    """A text block of ``system``."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolParam(OpenAIBaseModel):
    """One entry of ``tools``: a custom tool (``type`` absent or ``custom``) with the JSON
    Schema of its ``input``; Anthropic's server tools (``web_search_...``) are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None
    # declared to be refused when set (see messages_input.check_supported)
    defer_loading: bool | None = None
    allowed_callers: list[Any] | None = None
    input_examples: list[Any] | None = None


class ToolChoiceParam(RequestObject):
    """``tool_choice``: ``auto``, ``any`` (a call to some tool), ``tool`` (a call to ``name``)
    or ``none``; ``disable_parallel_tool_use`` allows one call at most."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesInput(RequestModel):
    """What a Messages request and a token count share: the conversation, the system prompt
    and the tools (and the fields refused in both)."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    # declared to be refused when set (see messages_input.check_supported)
    output_config: dict[str, Any] | None = None
    speed: str | None = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(MessagesInput):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API; ``metadata``
    (a ``user_id`` Anthropic uses against abuse) is accepted and not used; vLLM's
    ``kv_transfer_params`` is passed on as a chat request's is."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's prefill/decode field (not Anthropic's), as on chat completions: where this
    # request's decode runs
    kv_transfer_params: dict[str, Any] | None = None
    # declared to be refused when set (see messages_input.check_supported)
    container: Any = None
    inference_geo: str | None = None


class CountTokensRequest(MessagesInput):
    """``POST /v1/messages/count_tokens``."""


# --- responses ------------------------------------------------------------------------------


class TextBlock(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(OpenAIBaseModel):
    """A call: ``input`` holds the arguments (an object that validates against the tool's
    ``input_schema`` when the call was forced)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(OpenAIBaseModel):
    """The model's reasoning (with ``--reasoning-parser``); pyxllm signs nothing, so
    ``signature`` is empty."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = TextBlock | ToolUseBlock | ThinkingBlock


class Usage(OpenAIBaseModel):
    """Token counts: the prompt's ``input_tokens`` less those the prefix cache served
    (``cache_read_input_tokens``), so their sum is the prompt's length; pyxllm writes no cache
    entry a request pays for (``cache_creation_input_tokens`` is 0)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    service_tier: Literal["standard"] = "standard"


class Message(OpenAIBaseModel):
    """The body of a non-streamed answer (and of a stream's ``message_start``, then without
    content or stop reason)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock] = Field(default_factory=list)
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokensCount(OpenAIBaseModel):
    """The body of a token count: the prompt's length (system, messages and tools)."""

    input_tokens: int


# --- stream events --------------------------------------------------------------------------


class MessageStartEvent(OpenAIBaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(OpenAIBaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class ContentBlockDeltaEvent(OpenAIBaseModel):
    """A block's new part: ``{"type": "text_delta", "text"}``, ``{"type": "input_json_delta",
    "partial_json"}`` (the call's input as JSON text, in pieces) or ``{"type":
    "thinking_delta", "thinking"}``."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: dict[str, str]


class ContentBlockStopEvent(OpenAIBaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(OpenAIBaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaUsage(OpenAIBaseModel):
    """The final token counts (``input_tokens`` again: the prefix cache's share is known only
    once the request ran)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageDeltaEvent(OpenAIBaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(OpenAIBaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(OpenAIBaseModel):
    type: Literal["ping"] = "ping"


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
)
