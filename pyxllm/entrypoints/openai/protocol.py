"""Pydantic models of the OpenAI HTTP API, field for field, with vLLM's extensions marked.

A request body's fields that pyxllm does not know, at the top level or in one of its nested
objects of fixed keys (:class:`RequestObject`: ``stream_options.foo``), are refused with a 400
naming them, as OpenAI answers an unknown parameter (:meth:`RequestModel.check_unknown_fields`;
logged and ignored with ``--ignore-unknown-fields``, as vLLM does); fields we know but cannot honour
(``suffix``, ``best_of``...) are rejected by the serving layer rather than silently dropped.
Values are range-checked by :class:`~pyxllm.sampling_params.SamplingParams` (400 naming the
field). Logprobs in responses are clamped to -9999.0 where the token was ruled out (``-inf``
is not JSON), as vLLM does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    model_serializer,
    model_validator,
)

from pyxllm.entrypoints.openai.exceptions import OpenAIError

logger = logging.getLogger(__name__)


class OpenAIBaseModel(BaseModel):
    """Base of every request and response model: keys a model does not declare are dropped,
    unless it is a :class:`RequestObject` (kept, to be refused) or sets ``extra="allow"`` itself
    (kept, for a meaning of their own: a message's keys go to the chat template)."""

    model_config = ConfigDict(extra="ignore")


class RequestObject(OpenAIBaseModel):
    """A request object of fixed keys (a body, or an object nested in one: ``stream_options``,
    ``response_format``, a tool...): keys it does not declare are kept aside (``model_extra``)
    and refused by :meth:`RequestModel.check_unknown_fields` with their path.

    Free-form by design, and so not request objects: JSON Schemas (``parameters``, ``schema``),
    ``metadata``, ``logit_bias``, ``chat_template_kwargs`` (plain dicts), and the models whose
    other keys mean something (``extra="allow"`` on :class:`OpenAIBaseModel`): a chat message
    (its keys go to the chat template) and the tool calls it echoes, a content part or tool
    whose ``type`` pyxllm refuses by name."""

    model_config = ConfigDict(extra="allow")


def unknown_fields(value: Any, path: str = "") -> Iterator[tuple[RequestObject, str, str]]:
    """``(owner, key, path)`` of each key that a :class:`RequestObject` in ``value`` (a parsed
    request, or any model, list or value in one) does not declare: an object's own keys, then
    its fields' in declaration order; ``path`` is dotted from ``value``'s own
    (``tools[0].function.foo``). Dicts are free-form and not entered; a list is entered only
    when its first item is a model or a list (a list of token ids costs one check)."""
    if isinstance(value, BaseModel):
        if isinstance(value, RequestObject):
            for key in value.model_extra or ():
                yield value, key, f"{path}.{key}" if path else key
        for name, field in type(value).model_fields.items():
            key = field.alias or name
            yield from unknown_fields(getattr(value, name), f"{path}.{key}" if path else key)
    elif isinstance(value, list) and value and isinstance(value[0], (BaseModel, list)):
        for index, item in enumerate(value):
            yield from unknown_fields(item, f"{path}[{index}]")


# Deepest nesting of objects and arrays a request body may have (a tool's JSON Schema needs a
# few levels; thousands would make every recursive walk of the request a stack hazard).
MAX_JSON_DEPTH = 64


class RequestModel(RequestObject):
    """Base of the top-level request bodies: before any field is validated, the whole body is
    walked once and refused with a 400 naming the field (``OpenAIError``, which pydantic lets
    through) if a string holds a lone surrogate (``"\\udfff"`` is valid JSON but not Unicode
    text: no tokenizer or JSON encoder takes it) or objects nest deeper than
    :data:`MAX_JSON_DEPTH`. Fields the body or one of its :class:`RequestObject` s does not
    declare are kept aside (``model_extra``) for :meth:`check_unknown_fields`."""

    def check_unknown_fields(self, ignore: bool) -> None:
        """Refuse the body's undeclared fields, top-level or nested, with a 400 naming the
        first by its path (``stream_options.foo``; OpenAI's contract: a field pyxllm does not
        know is one it cannot honour), or with ``ignore`` (``--ignore-unknown-fields``) log
        them and drop them.

        Raises:
            OpenAIError: an undeclared field (``param``: its path), unless ``ignore``.
        """
        unknown = list(unknown_fields(self))
        if not unknown:
            return
        paths = [path for _, _, path in unknown]
        if not ignore:
            raise OpenAIError(
                f"{paths[0]}: unrecognized request argument"
                + (f" (also {', '.join(paths[1:])})" if len(paths) > 1 else "")
                + "; the server ignores unknown fields only when started with "
                "--ignore-unknown-fields",
                400,
                paths[0],
            )
        logger.warning("request fields ignored (not known to pyxllm): %s", ", ".join(paths))
        for owner, key, _ in unknown:
            del owner.model_extra[key]

    @model_validator(mode="before")
    @classmethod
    def _check_text_and_depth(cls, data: Any) -> Any:
        fault = _body_fault(data, "", 0)
        if fault is not None:
            path, problem = fault
            param = path.split(".")[0].split("[")[0] or None
            raise OpenAIError(f"{path or 'body'}: {problem}", 400, param)
        return data


# the JSON values with nothing in them to check
_SCALARS = frozenset((int, float, bool, type(None)))


def _body_fault(value: Any, path: str, depth: int) -> tuple[str, str] | None:
    """``(field path, problem)`` of the first lone surrogate or too deep nesting in a parsed
    JSON ``value``, else ``None``."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                code = ord(value[exc.start])
                return path, f"invalid Unicode: a lone surrogate U+{code:04X} at {exc.start}"
        return None
    if isinstance(value, (dict, list)):
        if depth >= MAX_JSON_DEPTH:
            return path, f"nested more than {MAX_JSON_DEPTH} levels deep"
        if isinstance(value, list) and set(map(type, value)) <= _SCALARS:
            return None  # numbers only (token ids): checked at C speed, ~30 ms a million
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                where = f"{path}.{key}" if path else key
                if (fault := _body_fault(key, where, depth)) is not None:
                    return where, f"{fault[1]} (in the key)"
            else:
                where = f"{path}[{key}]"
            if (fault := _body_fault(item, where, depth + 1)) is not None:
                return fault
    return None


class OmitNoneModel(OpenAIBaseModel):
    """A response model whose fields named in ``omit_if_none`` are left out while ``None``
    (OpenAI sends no ``null`` for them)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class StreamChunkModel(OmitNoneModel):
    """A stream chunk: ``usage`` appears only in the last chunk (with ``include_usage``)."""

    omit_if_none = ("usage",)


# --- errors -------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    """The body of an error: ``code`` is the HTTP status, ``param`` the offending field."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """``{"error": {...}}``, the one error shape of every endpoint."""

    error: ErrorInfo


# --- models and usage -----------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    """One entry of ``GET /v1/models``; ``root``, ``parent`` (a LoRA adapter's base model)
    and ``max_model_len`` are vLLM extensions."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pyxllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    """The body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens served from the
    prefix cache (OpenAI's field; sent with ``--enable-prompt-tokens-details``, as vLLM)."""

    cached_tokens: int = 0


class CompletionTokenUsageInfo(OpenAIBaseModel):
    """``usage.completion_tokens_details``: ``reasoning_tokens``, the completion tokens up to
    and with the end of the reasoning (OpenAI's field; sent by chat with
    ``--reasoning-parser``)."""

    reasoning_tokens: int = 0


class UsageInfo(OmitNoneModel):
    """Token counts of one request; ``prompt_tokens_details`` and
    ``completion_tokens_details`` are left out when ``None``."""

    omit_if_none = ("prompt_tokens_details", "completion_tokens_details")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    completion_tokens_details: CompletionTokenUsageInfo | None = None


class StreamOptions(RequestObject):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's; refused (see check_unsupported)


class JsonSchemaFormat(RequestObject):
    """``response_format.json_schema``: the schema the output must validate against (always
    enforced, whatever ``strict`` says)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestObject):
    """``response_format``: free ``text``, any ``json_object``, or ``json_schema``; another
    ``type`` is a 400 (as llama.cpp's server answers)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text),
    ``regex``, ``choice``, ``grammar`` (Lark or GBNF) and ``json_object``. Options pyxllm does not
    know are refused (400 naming them), not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(RequestModel):
    """Sampling fields shared by chat and completion requests (``None``: not given)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # structured outputs: at most one of these (see structured_outputs.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older spellings of structured_outputs' keys
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # llama.cpp's spellings: a JSON Schema, and a grammar (GBNF, or Lark)
    json_schema: dict[str, Any] | str | None = None
    grammar: str | None = None
    # vLLM's beam search: ``n`` beams, all returned as choices (see openai/beam_search.py)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM's prefill/decode field: where this request's decode runs (SamplingParams.extra_args)
    kv_transfer_params: dict[str, Any] | None = None
    # Declared so that a request using them is refused with a 400 naming the field
    # (``OpenAIServing.check_unsupported``) instead of being answered as if they were absent.
    best_of: int | None = None
    prompt_logprobs: int | None = None


# --- chat -----------------------------------------------------------------------------------


class ChatContentPart(OpenAIBaseModel):
    """One part of a message's ``content`` list; only ``{"type": "text"}`` parts are served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionDefinition(RequestObject):
    """A tool's function: ``parameters`` is the JSON Schema of its arguments (none: no
    arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(RequestObject):
    """One entry of a chat request's ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestObject):
    name: str


class NamedToolChoice(RequestObject):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    """A call's function: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One tool call of an assistant message (response, or an earlier turn in a request)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A stream chunk's part of a tool call: ``id``, ``type`` and the name come once, in the
    call's first chunk; then argument fragments whose concatenation is the call's arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionMessageParam(OpenAIBaseModel):
    """A message in a chat request; extra keys (``name`` ...) go to the template. An assistant
    turn may hold ``tool_calls`` (then ``content`` may be null), a ``tool`` turn answers one by
    its ``tool_call_id``."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatCompletionMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # at most this many reasoning tokens, then the end of the thinking is forced (needs
    # --reasoning-parser; default --reasoning-budget)
    thinking_token_budget: int | None = None


class ChatMessage(OmitNoneModel):
    """The assistant message of a non-streamed chat choice; ``reasoning_content`` and its alias
    ``reasoning`` (vLLM extensions) are set by ``--reasoning-parser``, else null;
    ``tool_calls`` is left out when there are none (as OpenAI sends it)."""

    omit_if_none = ("tool_calls",)
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    """A token with its logprob; ``bytes`` are the UTF-8 bytes of ``token``."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token's logprob and the ``top_logprobs`` most likely tokens at its place."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""

    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    """One choice of a non-streamed chat completion; ``stop_reason`` is a vLLM extension."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    """What a stream chunk adds to the message; unset fields are left out of the JSON."""

    role: str | None = None
    content: str | None = None
    # vLLM extensions, with --reasoning-parser: the same text under both names
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a chat stream chunk; ``finish_reason`` is null until the last one."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionStreamResponse(StreamChunkModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# --- completions --------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``; ``prompt`` is text or token ids (one prompt for now);
    ``max_tokens`` left out is 16 (OpenAI's and vLLM's default), ``null`` up to the context
    limit."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's and vLLM's default; an explicit null means up to the context limit
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    """``choices[].logprobs`` of a completion, one entry per token in each list: its text, its
    logprob (``None`` for the first prompt token with ``echo``), a ``{token: logprob}`` of the
    sampled token and the most likely ones, and where the token starts in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    """One choice of a non-streamed completion (also the shape of a stream chunk's choice)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    """The body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(StreamChunkModel):
    """One ``data:`` event of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
