"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API).

A Messages request is served by chat completions' code, as vLLM and SGLang serve it: it
becomes a chat request (:mod:`.messages_input`), goes through
:meth:`OpenAIServingChat.prepare_chat` (sampling parameters, tools, the chat template, the
input processor, a forced call's constraint), runs as a chat request does, and what chat makes
of the reply becomes content blocks (:mod:`.messages_output`) or Anthropic's stream events
(:mod:`.messages_stream`). Errors name Anthropic's fields (``stop_sequences``,
``tools[0].input_schema``) where chat's code names its own, and take Anthropic's shape
(:mod:`.errors`, chosen by the route).
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.entrypoints.anthropic.messages_input import (
    chat_request,
    check_supported,
    message_paths,
)
from pyxllm.entrypoints.anthropic.messages_output import content_blocks, message_usage, stop_reason
from pyxllm.entrypoints.anthropic.messages_stream import STOPPED, MessagesEvents
from pyxllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TokensCount,
)
from pyxllm.entrypoints.openai.chat.serving import OpenAIServingChat
from pyxllm.entrypoints.openai.chat.tools import plan_tools
from pyxllm.entrypoints.openai.errors import OpenAIError, renamed_fields
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected

_RENAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"^thinking_token_budget\b"), "thinking.budget_tokens"),
    (
        re.compile(r'send "required", a named function or "none"'),
        'send tool_choice {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}',
    ),
)


# a chat error's chat message (and content part), which message_paths maps to the request's
_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\](?:\.content\[(\d+)\])?")


def messages_field(
    text: str | None, paths: Callable[[], list[tuple[str, list[str]]]] = list
) -> str | None:
    """A chat error's message or field with the Messages API's field names: a chat message's
    index as the request's turn (and block) by ``paths()``
    (:func:`~pyxllm.entrypoints.anthropic.messages_input.message_paths` of the request, called
    only for such an error: it converts the request again), ``messages`` alone where they do
    not say."""
    if text is None:
        return None
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    match = _CHAT_MESSAGE.match(text)
    if match is not None:
        index, part = int(match[1]), match[2]
        where_from = paths()
        turn, parts = where_from[index] if index < len(where_from) else ("messages", [])
        if part is not None and int(part) < len(parts):
            where = parts[int(part)]
        else:
            where = turn + ("" if part is None or not parts else f".content[{part}]")
        text = where + text[match.end() :]
    return text


class AnthropicServingMessages:
    """Serves Anthropic's Messages API through a chat completions handler (its engine, parsers
    and checks; see the module docstring).

    Args:
        chat: the server's chat completions handler.
    """

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        """Answer one Messages request, streamed (Anthropic's SSE events) or not.

        Raises:
            OpenAIError: 400 naming a field that is invalid or cannot be honoured, 404 for an
                unknown model, 503 when the engine cannot serve, 500 when it stopped the
                request.
        """
        chat = self.chat
        chat.check_model(request.model)
        chat.check_health()
        chat.check_not_draining()
        check_supported(request)
        message_id = f"msg_{uuid.uuid4().hex}"
        served_as = chat_request(request)
        rename = functools.partial(messages_field, paths=lambda: message_paths(request))
        with renamed_fields(rename):
            prepared = await chat.prepare_chat(served_as, message_id)
        engine_request = prepared.engine_request
        if request.stream:
            token_bytes = chat.engine.tokenizer.token_bytes
            events = MessagesEvents(
                message_id, prepared, chat.response_model(engine_request), token_bytes
            )
            return chat.stream(engine_request, events, include_usage=False)
        try:
            with renamed_fields(rename):
                final = await chat.generate_full(engine_request, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        completion = final.outputs[0]
        choice = chat.full_choice(
            completion, engine_request.sampling_params, prepared.reasoning, prepared.tools
        )
        reason = stop_reason(choice.finish_reason, completion.stop_reason)
        if reason is None:
            raise OpenAIError(f"{STOPPED} (request id {message_id})", 500)
        response = Message(
            id=message_id,
            content=content_blocks(choice.message),
            model=chat.response_model(engine_request),
            stop_reason=reason[0],
            stop_sequence=reason[1],
            usage=message_usage(
                len(engine_request.prompt_token_ids),
                len(completion.token_ids),
                final.num_cached_tokens or 0,
            ),
        )
        return JSONResponse(response.model_dump(mode="json"))

    async def count_tokens(self, request: CountTokensRequest) -> JSONResponse:
        """``{"input_tokens"}``: the length of the prompt ``request`` would have as a Messages
        request (system, messages and the tools it offers, rendered by the chat template), what
        such a request's ``usage`` reports (``input_tokens`` plus ``cache_read_input_tokens``).

        Raises:
            OpenAIError: 400 naming a field that is invalid or cannot be honoured, 404 for an
                unknown model.
        """
        chat = self.chat
        chat.check_model(request.model)
        check_supported(request)
        served_as = chat_request(request)
        rename = functools.partial(messages_field, paths=lambda: message_paths(request))
        with renamed_fields(rename):
            tools = plan_tools(served_as, chat.tool_parser)
            tokens = await chat.tokenize(chat.chat_prompt(served_as, tools.mode != "none"))
        return JSONResponse(TokensCount(input_tokens=len(tokens.token_ids)).model_dump())
