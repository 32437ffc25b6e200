"""``POST /v1/responses`` (OpenAI's Responses API), and ``GET``/``DELETE /v1/responses/{id}``.

A Responses request is served by chat completions' code: it becomes a chat request
(:mod:`.input_items`), goes through :meth:`OpenAIServingChat.prepare_chat` (sampling
parameters, tools, the chat template, the input processor, a constraint compiled), runs as a
chat request does, and what chat makes of the reply (reasoning split off, tool calls found)
becomes output items (:mod:`.output_items`, :mod:`.run`). Errors name the
Responses fields (``max_output_tokens``, ``input``, ``text.format.schema``,
``tools[0].parameters``) where chat's code names its own.

Responses are kept (unless ``store: false``) in a :class:`ResponseStore` in memory, for
``previous_response_id`` and ``GET /v1/responses/{id}``: a conversation goes on from the stored
one (its input and output, not its ``instructions``, as with OpenAI).
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.entrypoints.openai.chat.serving import OpenAIServingChat
from pyxllm.entrypoints.openai.errors import OpenAIError, renamed_fields
from pyxllm.entrypoints.openai.middleware.security import key_owner
from pyxllm.entrypoints.openai.responses.input_items import (
    chat_request,
    check_supported,
    input_messages,
)
from pyxllm.entrypoints.openai.responses.protocol import (
    ResponseFormatText,
    ResponsesRequest,
    ResponsesResponse,
)
from pyxllm.entrypoints.openai.responses.run import ResponseRun, ResponsesEvents
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected
from pyxllm.sampling_params import SamplingParams

# How many responses the store keeps, and how many characters of conversation (JSON) in all;
# past either, the oldest are dropped first.
MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 2**20


@dataclass(slots=True)
class StoredResponse:
    """A kept response: its body, and its conversation as chat messages (input and output,
    without ``instructions``); ``size`` is both's length as JSON text; ``owner`` the API key
    that created it, the only one that can read, continue or delete it."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int
    owner: str | None = None  # the API key that created it (security.key_owner)


class ResponseStore:
    """Responses kept in memory, bounded by count and by size; the oldest go first.

    Args:
        max_responses: the most responses kept.
        max_chars: the most characters (of the bodies and conversations as JSON) kept; a
            response larger than this alone is not kept.
    """

    def __init__(
        self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS
    ) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        owner: str | None = None,
    ) -> None:
        """Keep a response of ``owner`` (see :class:`StoredResponse`), evicting the oldest ones
        past the bounds."""
        size = len(json.dumps(body)) + len(json.dumps(messages))
        if size > self.max_chars:
            return
        self.entries[response_id] = StoredResponse(body, messages, size, owner)
        self.chars += size
        while len(self.entries) > self.max_responses or self.chars > self.max_chars:
            self.chars -= self.entries.popitem(last=False)[1].size

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """``owner``'s kept response, ``None`` when it is not (never was, evicted, deleted, or
        another key's: to that key it does not exist)."""
        entry = self.entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Forget ``owner``'s response; False when it was not kept (or is another key's)."""
        if self.get(response_id, owner) is None:
            return False
        self.chars -= self.entries.pop(response_id).size
        return True


_TOOL_PARAMETERS = re.compile(r"\btools\[(\d+)\]\.function\.parameters\b")
_RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"^messages(\[\d+\])?"), "input"),
    (re.compile(r"^thinking_token_budget\b"), "reasoning.effort"),
)


def responses_field(text: str | None) -> str | None:
    """A chat error's message or field with Responses' field names
    (``max_completion_tokens`` -> ``max_output_tokens`` ...)."""
    if text is None:
        return None
    text = _TOOL_PARAMETERS.sub(r"tools[\1].parameters", text)
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


_MESSAGE_PART = re.compile(r"messages\[(\d+)\]\.content")


def _input_part(text: str | None, items: dict[int, int]) -> str | None:
    """``messages[k].content...`` as ``input[i].content...`` for the chat messages ``items``
    maps (chat index -> input index); other text unchanged."""
    if text is None or not items:
        return text
    return _MESSAGE_PART.sub(
        lambda m: (
            f"input[{items[int(m.group(1))]}].content" if int(m.group(1)) in items else m.group(0)
        ),
        text,
    )


class OpenAIServingResponses:
    """Serves the Responses API through a chat completions handler (its engine, parsers and
    checks; see the module docstring).

    Args:
        chat: the server's chat completions handler.
        store: where responses are kept (a new, empty one by default).
    """

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Answer one Responses request, streamed (SSE events) or not.

        Raises:
            OpenAIError: 400 naming a field that is invalid or cannot be honoured, 404 for an
                unknown model or ``previous_response_id``, 503 when the engine cannot serve.
        """
        chat = self.chat
        chat.check_model(request.model)
        chat.check_health()
        chat.check_not_draining()
        check_supported(request)
        owner = key_owner(raw_request)
        conversation = self.history(request.previous_response_id, owner)
        response_id = f"resp_{uuid.uuid4().hex}"
        sources: dict[int, int] = {}
        images = chat.processor.multimodal is not None
        with renamed_fields(responses_field):
            added = input_messages(request.input, images, sources)
        # a chat error naming an image message's part names the input item's
        first = len(conversation) + (1 if request.instructions else 0)
        items = {first + k: i for k, i in sources.items()}
        conversation = conversation + added
        with renamed_fields(lambda text: responses_field(_input_part(text, items))):
            prepared = await chat.prepare_chat(chat_request(request, conversation), response_id)
        engine_request = prepared.engine_request
        model = chat.response_model(engine_request)
        echo = self.echo(request, engine_request.sampling_params, model)
        prompt_tokens = len(engine_request.prompt_token_ids)
        run = ResponseRun(response_id, echo, prompt_tokens, prepared.reasoning)

        def keep(response: ResponsesResponse) -> None:
            if request.store is not False and response.status != "failed":
                messages = [*conversation, run.output.assistant_message()]
                self.store.put(response.id, response.model_dump(mode="json"), messages, owner)

        if request.stream:
            token_bytes = chat.engine.tokenizer.token_bytes
            events = ResponsesEvents(run, prepared, model, keep, token_bytes)
            return chat.stream(engine_request, events, include_usage=False)
        try:
            with renamed_fields(responses_field):
                final = await chat.generate_full(engine_request, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        completion = final.outputs[0]
        choice = chat.full_choice(
            completion, engine_request.sampling_params, prepared.reasoning, prepared.tools
        )
        message = choice.message
        logprobs = choice.logprobs.content if choice.logprobs is not None else None
        run.output.whole(
            message.reasoning_content, message.content, logprobs, message.tool_calls or []
        )
        response = run.finish(completion, choice.finish_reason, final.num_cached_tokens or 0)
        keep(response)
        return JSONResponse(response.model_dump(mode="json"))

    def history(
        self, previous_response_id: str | None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        """The conversation a request of ``owner`` (its API key) goes on from (empty without
        ``previous_response_id``).

        Raises:
            OpenAIError: 404 naming ``previous_response_id`` when ``owner`` has it not kept.
        """
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id, owner)
        if stored is None:
            raise OpenAIError(
                f"Previous response with id '{previous_response_id}' not found.",
                404,
                "previous_response_id",
            )
        return stored.messages

    def echo(self, request: ResponsesRequest, params: SamplingParams, model: str) -> dict[str, Any]:
        """The response fields that repeat the request (sampling values as applied; ``model``
        the name the answer reports, a LoRA adapter's or the served model's)."""
        text_format = (request.text and request.text.format) or ResponseFormatText(type="text")
        choice = request.tool_choice
        return {
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "metadata": request.metadata or {},
            "model": model,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {
                "effort": request.reasoning.effort if request.reasoning is not None else None,
                "summary": None,
            },
            "prompt_cache_key": request.prompt_cache_key,
            "safety_identifier": request.safety_identifier,
            "store": request.store is not False,
            "temperature": params.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True),
                "verbosity": "medium",
            },
            "tool_choice": choice.model_dump(exclude_none=True)
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [tool.model_dump() for tool in request.tools or ()],
            "top_logprobs": request.top_logprobs,
            "top_p": params.top_p,
            "user": request.user,
        }

    def retrieve(self, response_id: str, raw_request: Request) -> JSONResponse:
        """``GET /v1/responses/{id}``: a kept response's body.

        Raises:
            OpenAIError: 404 when it is not kept; 400 naming a query parameter (``stream``,
                ``include``, ``starting_after``: replaying a response's events is not served).
        """
        for name in raw_request.query_params:
            raise OpenAIError(f"{name}: not supported when retrieving a response", 400, name)
        return JSONResponse(self._stored(response_id, key_owner(raw_request)).body)

    def delete(self, response_id: str, raw_request: Request) -> JSONResponse:
        """``DELETE /v1/responses/{id}``: forget a kept response (404 when it is not kept, or
        another API key's)."""
        if not self.store.delete(response_id, key_owner(raw_request)):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, response_id: str, owner: str | None):
        stored = self.store.get(response_id, owner)
        if stored is None:
            raise _not_found(response_id)
        return stored


def _not_found(response_id: str) -> OpenAIError:
    """The 404 of a response that is not kept (or is another API key's)."""
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id")
