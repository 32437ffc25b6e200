"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``), field for field as the
``openai`` package's ``openai.types.responses`` types describe them: the request, the
response object, its output items, and the streamed events.

The request declares every Responses field pyxllm cannot honour too, so that the serving layer
(:mod:`.serving`) refuses a request using one with a 400 naming it; fields no version
of the API has are refused as unknown, as in :mod:`..protocol` (``text.format.foo`` too).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbsContent,
    OpenAIBaseModel,
    RequestModel,
    RequestObject,
)

# --- the request ------------------------------------------------------------------------------


class ResponseInputPart(OpenAIBaseModel):
    """One part of an input message's ``content`` (or of a function call output): only
    ``input_text`` and ``output_text`` parts are served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ResponseInputItem(OpenAIBaseModel):
    """One item of ``input``: a message (``type`` ``message`` or left out, with ``role`` and
    ``content``), a ``function_call`` (``call_id``, ``name``, ``arguments``), a
    ``function_call_output`` (``call_id``, ``output``) or a ``reasoning`` item (``content``
    parts of type ``reasoning_text``, else its ``summary``); the server refuses other types."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    role: str | None = None
    content: str | list[ResponseInputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponseInputPart] | None = None
    summary: list[ResponseInputPart] | None = None
    encrypted_content: str | None = None


class ResponseFunctionTool(OpenAIBaseModel):
    """One entry of ``tools``: a function (``type`` ``function``), whose ``parameters`` are the
    JSON Schema of its arguments. Other tool types (OpenAI's built-in tools) are refused."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoiceFunction(OpenAIBaseModel):
    """``tool_choice`` naming the one function the model must call (other object types, such
    as ``allowed_tools`` or a built-in tool, are refused)."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


class ResponseFormatText(RequestObject):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name`` and
    ``schema`` (always enforced, whatever ``strict`` says)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(RequestObject):
    """``text``: the output's ``format``; ``verbosity`` other than ``medium`` is refused."""

    format: ResponseFormatText | None = None
    verbosity: str | None = None


class ResponseReasoningConfig(OpenAIBaseModel):
    """``reasoning``: echoed as ``{"effort": ..., "summary": null}``; ``effort`` ``low``,
    ``medium`` or ``high`` is a thinking-token budget (with ``--reasoning-parser``), any other
    value, and a value in another field, is refused (pyxllm writes no summaries)."""

    model_config = ConfigDict(extra="allow")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(RequestObject):
    """``stream_options``: ``include_obfuscation: true`` is refused (events carry no
    obfuscation padding)."""

    include_obfuscation: bool | None = None


# The output item pyxllm fills in for ``include``'s one value it honours.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``.

    Served: ``model``, ``input`` (text or items), ``instructions``, ``max_output_tokens``,
    ``temperature``, ``top_p``, ``stream``, ``previous_response_id``, ``store``, ``tools``
    (functions), ``tool_choice``, ``parallel_tool_calls``, ``text.format``, ``include``
    (``message.output_text.logprobs``), ``top_logprobs``, ``metadata``, ``user``,
    ``safety_identifier``, ``prompt_cache_key`` (echoed; the prefix cache needs no key), and
    vLLM's ``kv_transfer_params`` (passed on as a chat request's is).
    The rest are declared only to be refused when given a value that asks for something.
    """

    model: str | None = None
    input: str | list[ResponseInputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = True
    text: ResponseTextConfig | None = None
    reasoning: ResponseReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's prefill/decode field, as on chat completions: where this request's decode runs
    kv_transfer_params: dict[str, Any] | None = None
    # refused unless left out or neutral (see serving.UNSUPPORTED)
    background: bool | None = None
    service_tier: str | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None
    image: Any = None
    access_programs: Any = None


# --- the response -----------------------------------------------------------------------------


class ResponseOutputText(OpenAIBaseModel):
    """An ``output_text`` part of a message; ``logprobs`` with ``include``'s
    ``message.output_text.logprobs``, one entry per generated token."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatCompletionLogProbsContent] | None = None


class ResponseReasoningText(OpenAIBaseModel):
    """A ``reasoning_text`` part of a reasoning item: the model's thinking, as
    ``--reasoning-parser`` splits it off."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputMessage(OpenAIBaseModel):
    """The assistant's text."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseReasoningItem(OpenAIBaseModel):
    """The model's reasoning (``summary`` stays empty: pyxllm writes no summaries)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: ItemStatus = "in_progress"


class ResponseFunctionToolCall(OpenAIBaseModel):
    """A function call: ``arguments`` is the JSON text the model wrote; ``call_id`` is what a
    ``function_call_output`` item answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = ResponseOutputMessage | ResponseReasoningItem | ResponseFunctionToolCall


class InputTokensDetails(OpenAIBaseModel):
    """The prompt tokens read from the cache and written to it."""

    cache_write_tokens: int = 0
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """Token counts; ``reasoning_tokens`` are the output tokens up to the end of the reasoning
    (its closing tag included)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(OpenAIBaseModel):
    """Why a response failed."""

    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"] | None = None


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesResponse(OpenAIBaseModel):
    """The response object: the body of ``POST /v1/responses`` and ``GET
    /v1/responses/{id}``, and the ``response`` of the stream's lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    background: bool = False
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


# --- the stream's events ----------------------------------------------------------------------


class ResponseStreamEvent(OpenAIBaseModel):
    """Base of the streamed events: ``type`` names the event, ``sequence_number`` counts the
    stream's events from 0."""

    type: str
    sequence_number: int = 0


class ResponseLifecycleEvent(ResponseStreamEvent):
    """``response.created``, ``response.in_progress``, ``response.completed``,
    ``response.incomplete`` and ``response.failed``: the response as it stands."""

    response: ResponsesResponse


class ResponseOutputItemEvent(ResponseStreamEvent):
    """``response.output_item.added`` and ``response.output_item.done``."""

    output_index: int
    item: OutputItem


class ResponseItemEvent(ResponseStreamEvent):
    """Base of the events about one output item: its ``item_id`` and ``output_index``."""

    item_id: str
    output_index: int


class ResponseContentEvent(ResponseItemEvent):
    """Base of the events about one content part of an item (pyxllm's items have one)."""

    content_index: int = 0


class ResponseContentPartEvent(ResponseContentEvent):
    """``response.content_part.added`` and ``response.content_part.done``."""

    part: ResponseOutputText | ResponseReasoningText


class ResponseTextDeltaEvent(ResponseContentEvent):
    """``response.output_text.delta``: new text, with the ``logprobs`` of the tokens behind it
    (without their bytes; empty unless asked for)."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseTextDoneEvent(ResponseContentEvent):
    """``response.output_text.done``: the message's whole text and its ``logprobs``."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseReasoningTextDeltaEvent(ResponseContentEvent):
    """``response.reasoning_text.delta``: new reasoning text."""

    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ResponseReasoningTextDoneEvent(ResponseContentEvent):
    """``response.reasoning_text.done``: the whole reasoning text."""

    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class ResponseFunctionCallArgumentsDeltaEvent(ResponseItemEvent):
    """``response.function_call_arguments.delta``: a fragment of a call's arguments."""

    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(ResponseItemEvent):
    """``response.function_call_arguments.done``: a call's whole arguments text."""

    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class ResponseErrorEvent(ResponseStreamEvent):
    """``error``: what went wrong after the stream started (``code``: the HTTP status)."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
