"""``POST /v1/chat/completions``: chat template -> engine -> JSON or SSE chunks."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pyxllm.engine.input_processor import ChatPrompt, EngineRequest
from pyxllm.engine.protocol import EngineClient
from pyxllm.entrypoints.chat_media import chat_images
from pyxllm.entrypoints.openai.chat.choices import (
    ChatEvents,
    chat_message,
    choice_logprobs,
    with_reasoning_tokens,
)
from pyxllm.entrypoints.openai.chat.reasoning import ReasoningParser, reasoning_parser_for
from pyxllm.entrypoints.openai.chat.tool_parsers import (
    ToolParser,
    get_tool_parser,
    split_tool_calls,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import (
    ToolParserChoice,
    resolve_tool_parser,
    template_renders_tools,
)
from pyxllm.entrypoints.openai.chat.tools import ToolPlan, plan_tools, template_messages, tool_specs
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
)
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing
from pyxllm.outputs import CompletionOutput
from pyxllm.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)


class PreparedChat(NamedTuple):
    """A chat request ready to run: the engine's request, the parser splitting off its
    reasoning (``None``: nothing to split) and how its reply is read for tool calls."""

    engine_request: EngineRequest
    reasoning: ReasoningParser | None
    tools: ToolPlan


def choose_auto_tool_parser(options: ServerOptions, chat_template: str | None) -> ToolParserChoice:
    """The tool-call parser that reads ``tool_choice: "auto"`` for a model with
    ``chat_template`` under ``options.tool_call_parser``
    (:func:`~.tool_parsers.auto.resolve_tool_parser`). A pure function of the flags and the
    template, so that the server can run it before the model loads when ``--chat-template``
    gives the template.

    Raises:
        ValueError: ``options.enable_auto_tool_choice`` (vLLM's flag: ``auto`` must be
            served) and no parser reads this template's calls, naming the flag and why.
    """
    choice = resolve_tool_parser(options.tool_call_parser, chat_template)
    if choice.name is None and options.enable_auto_tool_choice:
        raise ValueError(
            f"--enable-auto-tool-choice: no tool-call parser: {choice.reason}; name one with "
            "--tool-call-parser"
        )
    return choice


class OpenAIServingChat(OpenAIServing):
    """Serves chat completions from one engine, streamed or not.

    With ``options.reasoning_parser`` (a registered name, e.g. ``"qwen3"``) the generated text is
    split into ``reasoning_content`` (also sent as ``reasoning``) and ``content``, unless the
    prompt already closed the reasoning (then all of it is content). ``tool_choice: "auto"`` is
    read by the parser ``options.tool_call_parser`` names, or chooses from the chat template
    (``auto``, :func:`~.tool_parsers.auto.choose_tool_parser`); the log says which and why.

    Raises:
        ValueError: an unknown ``reasoning_parser`` or ``tool_call_parser``, or no tool-call
            parser for this chat template with ``options.enable_auto_tool_choice``.
    """

    def __init__(self, engine: EngineClient, options: ServerOptions | None = None):
        super().__init__(engine, options)
        template = getattr(engine.tokenizer.hf, "chat_template", None)
        self.reasoning_parser: ReasoningParser | None
        name, self.reasoning_parser = reasoning_parser_for(
            self.options.reasoning_parser, engine.tokenizer
        )
        if self.options.reasoning_parser == "auto":
            chosen = name or "none (the chat template has no reasoning markers)"
            logger.info("--reasoning-parser auto: %s", chosen)
        self.template_renders_tools = template_renders_tools(template)
        self.tool_parser_choice = choose_auto_tool_parser(self.options, template)
        name = self.tool_parser_choice.name
        self.tool_parser: ToolParser | None = None
        if name is not None:
            self.tool_parser = get_tool_parser(name)(engine.tokenizer)
        if engine.task == "generate":  # a pooling server answers no chat
            logger.info(
                'tool_choice "auto": %s (%s)',
                f"the {name} tool-call parser" if name else "refused",
                self.tool_parser_choice.reason,
            )

    def request_reasoning(
        self, request: ChatCompletionRequest, prompt_token_ids: list[int]
    ) -> tuple[ReasoningParser | None, dict]:
        """The parser splitting this request's text (``None`` when nothing is to be split:
        no parser, or the prompt already closed the reasoning), and the sampling fields it
        needs: special tokens kept when its tags are special, unless the request chose; the
        thinking budget (the request's ``thinking_token_budget``, else ``--reasoning-budget``)
        with the tags that open and close the thinking. A budget is ignored when the prompt
        closed the reasoning (nothing to cut).

        Raises:
            OpenAIError: 400 naming ``thinking_token_budget`` when it is negative, or given
                to a server without a reasoning parser (no end of thinking to force).
        """
        parser, budget = self.reasoning_parser, request.thinking_token_budget
        if budget is not None and parser is None:
            raise OpenAIError(
                "thinking_token_budget: needs a reasoning parser (start the server with "
                "--reasoning-parser)",
                400,
                "thinking_token_budget",
            )
        if budget is not None and budget < 0:
            raise OpenAIError(
                f"thinking_token_budget: must be >= 0, got {budget}", 400, "thinking_token_budget"
            )
        if parser is None or parser.is_reasoning_end(prompt_token_ids):
            return None, {}
        fields = {}
        if parser.needs_special_tokens and request.skip_special_tokens is None:
            fields["skip_special_tokens"] = False
        budget = self.options.reasoning_budget if budget is None else budget
        if budget is not None:
            fields.update(
                thinking_token_budget=budget,
                think_start_token_ids=parser.start_token_ids(),
                think_end_token_ids=parser.end_token_ids(),
            )
        return parser, fields

    async def prepare_chat(self, request: ChatCompletionRequest, request_id: str) -> PreparedChat:
        """The engine request of a chat request (its sampling parameters, tools, prompt and
        reasoning parser), its constraint compiled: what chat completions and the Responses
        API (:mod:`..responses.serving`) run.

        The sampling parameters are built once everything they depend on is known: a forced
        tool call's constraint, and the reasoning and tool-call parsers (whose special-token
        tags are kept in the text unless the request says otherwise).

        Raises:
            OpenAIError, InvalidRequestError: a field that is out of range, cannot be honoured
                or does not fit (400 naming it).
        """
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        elif max_tokens < 1:
            raise OpenAIError(
                f"max_completion_tokens: must be >= 1, got {max_tokens}",
                400,
                "max_completion_tokens",
            )
        fields = self.sampling_fields(request, max_tokens, logprobs=requested_logprobs(request))
        tools = plan_tools(request, self.tool_parser, self.tool_parser_choice.reason)
        if tools.mode != "none":
            await self.check_tools(request)
        if tools.constraint is not None:
            # a forced call's schema shapes the reply; OpenAI takes response_format beside it
            # (it shapes text, and there is none), vLLM's constraint fields are refused
            current = fields["structured_outputs"]
            field = None if current is None else current.source.split(".")[0]
            if field not in (None, "response_format"):
                raise OpenAIError(
                    f"{field}: cannot be combined with tool_choice {request.tool_choice!r}"
                    if isinstance(request.tool_choice, str)
                    else f"{field}: cannot be combined with a named tool_choice",
                    400,
                    field,
                )
            fields["structured_outputs"] = tools.constraint
        offer_tools = tools.mode != "none"
        if _has_media(request):  # off the event loop: images are decoded, http(s) ones fetched
            prompt = await asyncio.to_thread(self.chat_prompt, request, offer_tools)
        else:
            prompt = self.chat_prompt(request, offer_tools)
        tokens = await self.tokenize(prompt)
        reasoning, reasoning_fields = self.request_reasoning(request, list(tokens.token_ids))
        fields.update(reasoning_fields)
        if tools.mode == "auto" and tools.parser.needs_special_tokens:
            if request.skip_special_tokens is None:  # the parser's tags are special tokens
                fields["skip_special_tokens"] = False
        engine_request = self.processor.process(
            request_id,
            tokens,
            self.build_sampling_params(fields),
            max_tokens_param="max_tokens"
            if request.max_completion_tokens is None
            else "max_completion_tokens",
            constrain_after=() if reasoning is None else reasoning.end_token_ids(),
            lora_request=self.lora_request(request.model),
        )
        await self.prepare(engine_request)
        return PreparedChat(engine_request, reasoning, tools)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Answer one chat request (raises :class:`OpenAIError` for a bad request)."""
        self.check_model(request.model)
        self.check_health()
        self.check_not_draining()
        chat = await self.prepare_chat(request, f"chatcmpl-{uuid.uuid4().hex}")
        engine_request, reasoning, tools = chat.engine_request, chat.reasoning, chat.tools
        search = self.beam_search(request, engine_request)
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            events = ChatEvents(
                engine_request,
                created,
                self.response_model(engine_request),
                reasoning,
                tools,
                self.engine.tokenizer.token_bytes,
            )
            return self.stream(engine_request, events, include_usage, search)
        try:
            final = await self.generate_full(engine_request, raw_request, search)
        except ClientDisconnected:
            return Response(status_code=499)
        params = engine_request.sampling_params
        response = ChatCompletionResponse(
            id=engine_request.request_id,
            created=created,
            model=self.response_model(engine_request),
            choices=[self.full_choice(c, params, reasoning, tools) for c in final.outputs],
            usage=with_reasoning_tokens(
                self.usage(engine_request, sum(len(c.token_ids) for c in final.outputs), final),
                reasoning,
                [c.token_ids for c in final.outputs],
            ),
        )
        return JSONResponse(response.model_dump(mode="json"))

    def full_choice(
        self,
        completion: CompletionOutput,
        params: SamplingParams,
        reasoning: ReasoningParser | None,
        tools: ToolPlan,
    ) -> ChatCompletionResponseChoice:
        """The choice of a finished completion: its message (reasoning split off, tool calls
        found in the rest) and finish reason (``tool_calls`` when calls came back)."""
        message, finish_reason = chat_message(completion.text, reasoning), completion.finish_reason
        if tools.parser is not None:
            message.content, calls = split_tool_calls(
                tools.parser, message.content or "", tools.limit
            )
            message.tool_calls = calls or None
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return ChatCompletionResponseChoice(
            index=completion.index,
            message=message,
            logprobs=choice_logprobs(completion, params, self.engine.tokenizer.token_bytes),
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        )

    async def check_tools(self, request: ChatCompletionRequest) -> None:
        """400 naming ``tools[i].function.parameters`` for a schema the grammar backend cannot
        compile (compiled off the event loop, and cached for the calls that need them)."""
        for spec in tool_specs(request):
            await self.processor.structured_outputs.submit(spec).wait()

    def chat_prompt(self, request: ChatCompletionRequest, offer_tools: bool = True) -> ChatPrompt:
        """The request's messages as plain dicts for the chat template (text parts joined by
        newlines, tool calls and results as :func:`~.tools.template_messages` writes them);
        ``chat_template_kwargs`` may override ``add_generation_prompt``. The tools reach the
        template (or a system message) when ``offer_tools``.

        Image parts become the model's image tokens and the prompt's ``multi_modal_data``
        (:func:`~pyxllm.entrypoints.chat_media.chat_images`).

        Raises:
            OpenAIError: no messages, or a tool message without ``tool_call_id``.
            InvalidRequestError: a content part other than text and images, or an image that
                cannot be read, is too many or is sent to a text model (400 naming
                ``messages[i].content[j]``).
        """
        if not request.messages:
            raise OpenAIError("messages: must contain at least one message", 400, "messages")
        if len(request.messages) > self.limits.max_messages:
            raise OpenAIError(
                f"messages: at most {self.limits.max_messages} messages, "
                f"got {len(request.messages)}",
                400,
                "messages",
            )
        messages = [message.model_dump(exclude_none=True) for message in request.messages]
        messages, mm_data = chat_images(
            messages,
            self.processor,
            getattr(self.engine.tokenizer.hf, "chat_template", None),
        )
        tools = (request.tools or []) if offer_tools else []
        messages = template_messages(messages, tools, self.template_renders_tools)
        kwargs = dict(request.chat_template_kwargs or {})
        self.check_request_template(request, kwargs)
        if tools and self.template_renders_tools:
            kwargs.setdefault("tools", [t.model_dump(exclude_none=True) for t in tools])
        add_generation_prompt = kwargs.pop("add_generation_prompt", request.add_generation_prompt)
        return ChatPrompt(messages, add_generation_prompt, kwargs, mm_data)

    def check_request_template(self, request: ChatCompletionRequest, kwargs: dict) -> None:
        """Put a request's own ``chat_template`` into the template ``kwargs``, if the server
        trusts request templates (``--trust-request-chat-template``, as vLLM's flag).

        Raises:
            OpenAIError: a template given to a server that does not trust them (400 naming
                ``chat_template`` or ``chat_template_kwargs``).
        """
        given = [
            name
            for name, present in (
                ("chat_template", request.chat_template is not None),
                ("chat_template_kwargs", "chat_template" in kwargs),
            )
            if present
        ]
        if given and not self.options.trust_request_chat_template:
            raise OpenAIError(
                f"{given[0]}: this server does not render chat templates sent with a request "
                "(start it with --trust-request-chat-template to allow them)",
                400,
                given[0],
            )
        if request.chat_template is not None:
            kwargs["chat_template"] = request.chat_template


def _has_media(request: ChatCompletionRequest) -> bool:
    """Whether a message holds a content part other than text (an image to read)."""
    return any(
        isinstance(m.content, list) and any(p.type != "text" for p in m.content)
        for m in request.messages
    )


def requested_logprobs(request: ChatCompletionRequest) -> int | None:
    """The number of top logprobs per token the request asks for, ``None`` without ``logprobs``.

    Raises:
        OpenAIError: ``top_logprobs`` out of [0, 20], or above 0 without ``logprobs: true``.
    """
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIError(
            f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}", 400, "top_logprobs"
        )
    if top and not request.logprobs:
        raise OpenAIError("top_logprobs: requires logprobs to be true", 400, "top_logprobs")
    return (top or 0) if request.logprobs else None
