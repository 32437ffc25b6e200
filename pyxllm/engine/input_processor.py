"""The front door of every request: prompt and sampling fields in, one validated request out.

vLLM's ``InputProcessor`` -> ``EngineCoreRequest`` is the model. The OpenAI server,
``pyxllm generate`` and :class:`~pyxllm.entrypoints.llm.LLM` each call
:meth:`InputProcessor.process` once per request; the engine queues the :class:`EngineRequest`
it returns and checks nothing again. Every rule a request must satisfy lives here, once:

- the prompt: text (tokenized with the model's tokenizer), chat messages (rendered with the
  model's chat template) or token ids; never empty; every token id ``0 <= id < vocab_size``, the
  model's embedding rows (a tokenizer may have fewer tokens than the embedding has rows: Qwen's
  151,669 against 151,936; ids in between are valid model inputs);
- the token ids of ``stop_token_ids`` and ``logit_bias``, by the same vocabulary rule;
- the model's generation defaults (``generation_config.json``) for the sampling fields the
  request left unset (:meth:`SamplingParams.with_model_defaults`);
- ``max_tokens``: ``None`` becomes the model's ``max_new_tokens`` capped to the room the context
  leaves, else that room; the prompt plus ``max_tokens`` must fit ``max_model_len`` and the KV
  cache (one message, naming the numbers);
- a structured-output constraint needs a grammar backend; :meth:`InputProcessor.constraint`
  starts compiling it (off the caller's thread), and the server and ``LLM`` wait on that to
  refuse a constraint that does not compile before the request runs. The request itself stays a
  plain value: the engine compiles (or finds in its cache) the grammar it follows (see
  :mod:`pyxllm.engine.structured_output`).

A new per-request option (a structured-output spec, a tool parser, speculative settings) becomes
a field of :class:`EngineRequest`, checked here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pyxllm.engine.errors import InvalidRequestError
from pyxllm.engine.multimodal import MultiModalProcessor
from pyxllm.engine.structured_output import GrammarHandle, StructuredOutputManager
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.lora_request import LoRARequest
from pyxllm.multimodal_inputs import MultiModalFeatureSpec
from pyxllm.pooling_params import PoolingParams
from pyxllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A prompt as text; ``add_special_tokens`` lets the tokenizer add its BOS token (if any).

    ``multi_modal_data`` (vLLM's): ``{"image": PIL image or list of them}``, one per image
    token of the text, for a vision-language model (see :mod:`pyxllm.engine.multimodal`).
    """

    text: str
    add_special_tokens: bool = True
    multi_modal_data: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages (OpenAI-style dicts) to render with the model's chat template.

    ``chat_template_kwargs`` reach the template (``enable_thinking=False``, ``tools=[...]``);
    ``multi_modal_data``: the images the rendered messages hold image tokens for, in order
    (see :class:`TextPrompt`; ``pyxllm.entrypoints.chat_media`` takes them out of the parts).
    """

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    multi_modal_data: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TokensPrompt:
    """A prompt as token ids (vLLM's ``TokensPrompt``).

    ``text`` is the prompt's text where there is one (it is returned in the request's output);
    ``param`` is the request field the ids came from, named in errors (``"messages"`` for a
    rendered chat); ``multi_modal_data``: see :class:`TextPrompt`.
    """

    token_ids: Sequence[int]
    text: str | None = None
    param: str = "prompt"
    multi_modal_data: Mapping[str, Any] | None = None


Prompt = str | TextPrompt | ChatPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One validated request, as the engine queues it.

    Attributes:
        request_id: unique among the engine's live requests.
        prompt_token_ids: the prompt's token ids, each in ``[0, vocab_size)``.
        prompt: the prompt's text, ``None`` for token ids and chats.
        sampling_params: the request's :class:`SamplingParams` with the model's generation
            defaults applied and ``max_tokens`` an int: prompt plus ``max_tokens`` fit
            ``max_model_len`` and the KV cache.
        arrival_time: ``time.monotonic()`` seconds when the request was processed (TTFT and
            end-to-end latency count from here).
        constrain_after: token ids that end the model's reasoning (``</think>``): the
            constraint applies to what follows them in the output, not to the reasoning
            (vLLM's behaviour); empty: from the first token.
        pooling_params: an embedding request's (see :meth:`InputProcessor.process_pooling`),
            ``None`` for generation.
        lora_request: the LoRA adapter to run it with (``--enable-lora``), ``None``: the base
            model.
        mm_features: its images, in prompt order (each image token of the prompt is expanded
            to its placeholder run), empty for text.
    """

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    sampling_params: SamplingParams
    arrival_time: float
    constrain_after: tuple[int, ...] = ()
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()


class InputProcessor:
    """Turns a prompt and its sampling parameters into an :class:`EngineRequest`.

    Thread-safe: it reads its configuration and calls the tokenizer only.

    Args:
        tokenizer: the engine's tokenizer (and chat template).
        vocab_size: the model's vocabulary size (its embedding's rows).
        max_model_len: the context limit in tokens.
        max_kv_blocks: blocks in the KV cache; a request must fit it alone.
        block_size: tokens per KV block.
        generation_defaults: the model's request defaults by field name
            (:class:`~pyxllm.weights.GenerationDefaults.sampling`: ``temperature``, ``top_p``,
            ``top_k``, ``min_p``, ``repetition_penalty``, ``max_tokens``; those present).
        structured_outputs: compiles constraints; ``None`` refuses them.
        embedding_size: an embedding model's vector length (``hidden_size``; the embed task),
            the most ``dimensions`` a request may ask for; ``None`` for generation.
        class_labels: a classifier's label names by class index (its config's ``id2label``;
            the score and classify tasks), ``None`` for other models.
        multimodal: a vision-language model's image processing, ``None`` for a text model
            (which refuses images).
        kv_transfer: whether the engine moves KV between instances (``--kv-offload-dir``,
            which ``--kv-role``, ``--kv-transfer-push`` and ``--kv-transfer-listen`` need):
            without it, a request's ``kv_transfer_params`` is refused, as nothing would act
            on it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_kv_blocks: int,
        block_size: int,
        generation_defaults: Mapping[str, float | int] | None = None,
        structured_outputs: StructuredOutputManager | None = None,
        embedding_size: int | None = None,
        class_labels: tuple[str, ...] | None = None,
        multimodal: MultiModalProcessor | None = None,
        kv_transfer: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_kv_blocks = max_kv_blocks
        self.block_size = block_size
        self.generation_defaults = dict(generation_defaults or {})
        self.structured_outputs = structured_outputs
        self.embedding_size = embedding_size
        self.class_labels = class_labels
        self.multimodal = multimodal
        self.kv_transfer = kv_transfer

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        max_tokens_param: str = "max_tokens",
        constrain_after: tuple[int, ...] = (),
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """The validated request for ``prompt`` with ``params`` (default ``SamplingParams()``);
        errors about the completion's length name ``max_tokens_param`` (the chat API's
        ``max_completion_tokens`` when the request used it); ``constrain_after`` and
        ``lora_request``: see :class:`EngineRequest`.

        Raises:
            InvalidRequestError: (a ``ValueError``) the prompt is empty, cannot be tokenized or
                rendered, holds a token id outside the vocabulary; a ``stop_token_ids`` or
                ``logit_bias`` id is outside it; a model default is out of range; or the prompt
                plus ``max_tokens`` do not fit the context or the KV cache; or
                ``kv_transfer_params`` comes to an engine that moves no KV.
        """
        params = SamplingParams() if params is None else params
        if (params.extra_args or {}).get("kv_transfer_params") is not None and not self.kv_transfer:
            raise InvalidRequestError(
                "kv_transfer_params: this server moves no KV between instances (it was started "
                "without --kv-offload-dir, --kv-role or --kv-transfer-push/--kv-transfer-listen), "
                "so nothing would act on it",
                "kv_transfer_params",
            )
        tokens = prompt if isinstance(prompt, TokensPrompt) else self.tokenize(prompt)
        ids = [int(t) for t in tokens.token_ids]
        if not ids or tokens.text == "":
            raise InvalidRequestError(f"{tokens.param}: must not be empty", tokens.param)
        self.check_token_ids(ids, tokens.param)
        ids, mm_features = self.process_multimodal(ids, tokens)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(params.logit_bias or (), "logit_bias")
        if params.thinking_token_budget is not None and not params.think_end_token_ids:
            raise InvalidRequestError(
                "thinking_token_budget: needs think_end_token_ids, the tokens that end the "
                "reasoning (the server takes them from --reasoning-parser, LLM from its "
                "reasoning_parser)",
                "thinking_token_budget",
            )
        thinking_ids = (*params.think_start_token_ids, *params.think_end_token_ids)
        self.check_token_ids(thinking_ids, "thinking_token_budget")
        try:
            params = params.with_model_defaults(self.generation_defaults)
        except ValueError as exc:
            raise InvalidRequestError(f"the model's generation_config.json: {exc}", None) from exc
        max_tokens = self.resolve_max_tokens(
            len(ids), params.max_tokens, tokens.param, max_tokens_param
        )
        if max_tokens != params.max_tokens:
            params = params.replace(max_tokens=max_tokens)
        constrained = params.structured_outputs is not None
        if constrained and self.structured_outputs is None:
            raise InvalidRequestError(
                "structured_outputs: this engine has no grammar backend", "structured_outputs"
            )
        now = time.monotonic() if arrival_time is None else arrival_time
        return EngineRequest(
            request_id,
            ids,
            tokens.text,
            params,
            now,
            constrain_after if constrained else (),
            lora_request=lora_request,
            mm_features=mm_features,
        )

    def process_multimodal(
        self, ids: list[int], tokens: TokensPrompt
    ) -> tuple[list[int], tuple[MultiModalFeatureSpec, ...]]:
        """``ids`` with their image tokens expanded, and the images' feature specs (see
        :meth:`MultiModalProcessor.process`); ``ids`` unchanged for a text model.

        Raises:
            InvalidRequestError: images for a text model, a modality other than ``image``, or
                what :meth:`MultiModalProcessor.process` refuses.
        """
        data = dict(tokens.multi_modal_data or {})
        images = data.pop("image", None)
        if data:
            raise InvalidRequestError(
                f"multi_modal_data: unknown modality {next(iter(data))!r} (served: image)",
                "multi_modal_data",
            )
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if self.multimodal is None:
            if images:
                raise InvalidRequestError(
                    f"{tokens.param}: this model reads text only; images are not supported",
                    tokens.param,
                )
            return ids, ()
        return self.multimodal.process(ids, list(images), tokens.param)

    def constraint(self, request: EngineRequest) -> GrammarHandle | None:
        """The request's constraint, compiling or compiled (``None`` without one): wait on it
        (``compiled()``, or ``await wait()``; they raise ``InvalidRequestError`` naming the
        field when it does not compile) to refuse a bad constraint before the request runs.
        The compiled grammar is cached, so an engine in this process finds it ready."""
        spec = request.sampling_params.structured_outputs
        return None if spec is None else self.structured_outputs.submit(spec)

    def process_pooling(
        self,
        request_id: str,
        prompt: str | tuple[str, str] | TokensPrompt,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        arrival_time: float | None = None,
        param: str = "input",
    ) -> EngineRequest:
        """The validated pooling request for ``prompt`` (text, tokenized with special tokens; a
        text pair for a cross-encoder, tokenized as the tokenizer pairs texts, ``[CLS] a [SEP]
        b [SEP]`` for BERT, its second segment's start set as the request's
        ``pooling_params.token_type_start``; or token ids): prefill only, its output a pooled
        vector (vLLM's pooling requests).

        Args:
            truncate_prompt_tokens: keep at most this many tokens (``-1``: ``max_model_len``):
                text is tokenized with the tokenizer's truncation (a BERT tokenizer keeps
                ``[CLS]``, the first tokens and ``[SEP]``; a pair loses tokens from its longer
                text first), token ids keep their last ones (vLLM's rules); ``None``: a longer
                prompt is refused.
            param: the request field errors about text name (``TokensPrompt`` has its own).

        Raises:
            InvalidRequestError: an empty prompt, a token id outside the vocabulary, a prompt
                longer than ``max_model_len`` without truncation (naming ``param``), a bad
                ``truncate_prompt_tokens`` or ``dimensions``, or ``dimensions`` or
                ``normalize`` for a classifier.
        """
        params = pooling_params or PoolingParams()
        if self.class_labels is not None:
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name}: applies to embedding models; this one classifies", name
                    )
        size = self.embedding_size
        if size is not None and (params.dimensions or 0) > size:
            raise InvalidRequestError(
                f"dimensions: {params.dimensions} exceeds the model's embedding size ({size})",
                "dimensions",
            )
        limit = truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and not 1 <= limit <= self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens: must be -1 or in [1, {self.max_model_len}] "
                f"(max_model_len), got {truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        if isinstance(prompt, TokensPrompt):
            ids = [int(t) for t in prompt.token_ids]
            if limit is not None:
                ids = ids[len(ids) - limit :] if len(ids) > limit else ids
            text, param = prompt.text, prompt.param
        elif isinstance(prompt, tuple):
            text = None
            ids, types = self._tokenize_pair(prompt, limit, param)
            start = types.index(1) if 1 in types else None
            params = replace(params, token_type_start=start)
        else:
            text = prompt
            try:
                if limit is None:
                    ids = self.tokenizer.encode(text)
                else:
                    ids = list(
                        self.tokenizer.hf(text, truncation=True, max_length=limit)["input_ids"]
                    )
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"{param}: cannot be tokenized ({exc})", param) from exc
        if not ids or text == "":
            raise InvalidRequestError(f"{param}: must not be empty", param)
        self.check_token_ids(ids, param)
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum input length is {self.max_model_len} tokens "
                f"(max_model_len), but the input has {len(ids)} tokens; shorten it or set "
                "truncate_prompt_tokens.",
                param,
            )
        needed = -(-len(ids) // self.block_size)
        if needed > self.max_kv_blocks:
            raise InvalidRequestError(
                f"{param}: {len(ids)} tokens need {needed} KV blocks but the cache has "
                f"{self.max_kv_blocks}; raise --kv-cache-memory",
                param,
            )
        now = time.monotonic() if arrival_time is None else arrival_time
        sampling = SamplingParams(max_tokens=1)
        return EngineRequest(request_id, ids, text, sampling, now, pooling_params=params)

    def _tokenize_pair(
        self, pair: tuple[str, str], limit: int | None, param: str
    ) -> tuple[list[int], list[int]]:
        """A text pair's token ids and token types (all 0 where the tokenizer gives none),
        truncated to ``limit`` tokens when it is given."""
        truncation = {} if limit is None else {"truncation": True, "max_length": limit}
        try:
            encoded = self.tokenizer.hf(pair[0], pair[1], **truncation)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{param}: cannot be tokenized ({exc})", param) from exc
        ids = list(encoded["input_ids"])
        return ids, list(encoded.get("token_type_ids") or [0] * len(ids))

    def tokenize(self, prompt: str | TextPrompt | ChatPrompt) -> TokensPrompt:
        """The token ids of a text or chat prompt (a ``str`` is a :class:`TextPrompt`).

        Raises:
            InvalidRequestError: text the tokenizer refuses (a lone surrogate), messages the
                chat template cannot render (naming ``chat_template_kwargs`` when those are at
                fault), or a chat rendered to nothing.
        """
        if isinstance(prompt, str):
            prompt = TextPrompt(prompt)
        if isinstance(prompt, TextPrompt):
            try:
                ids = self.tokenizer.encode(prompt.text, prompt.add_special_tokens)
            except (TypeError, ValueError) as exc:  # e.g. a lone surrogate in the text
                raise InvalidRequestError(f"prompt: cannot be tokenized ({exc})", "prompt") from exc
            return TokensPrompt(ids, prompt.text, multi_modal_data=prompt.multi_modal_data)
        try:
            ids = self.tokenizer.apply_chat_template(
                list(prompt.messages), prompt.add_generation_prompt, **prompt.chat_template_kwargs
            )
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(str(exc), self._template_fault(prompt)) from exc
        if not ids:
            raise InvalidRequestError(
                "messages: the chat template rendered an empty prompt", "messages"
            )
        return TokensPrompt(ids, None, "messages", prompt.multi_modal_data)

    def _template_fault(self, prompt: ChatPrompt) -> str:
        """The field at fault when ``prompt`` does not render: ``chat_template_kwargs`` when
        the messages render without them (a reserved name, a clashing or ill-typed value),
        else ``messages``."""
        if not prompt.chat_template_kwargs:
            return "messages"
        try:
            self.tokenizer.apply_chat_template(list(prompt.messages), prompt.add_generation_prompt)
        except (TypeError, ValueError):
            return "messages"
        return "chat_template_kwargs"

    def check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        """The one vocabulary rule: every id is in ``[0, vocab_size)``.

        Raises:
            InvalidRequestError: naming ``param`` and the first id out of range.
        """
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"{param}: token id {token_id} is out of range [0, {self.vocab_size})", param
                )

    def resolve_max_tokens(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        param: str,
        max_tokens_param: str = "max_tokens",
    ) -> int:
        """The new tokens a request may generate: ``max_tokens``, or when ``None`` the model's
        default capped to the room the context leaves, else that room.

        Raises:
            InvalidRequestError: the prompt plus the completion (at least 1 token) do not fit
                ``max_model_len`` (naming ``max_tokens_param`` when the prompt alone fits, else
                the prompt's field ``param``), or the KV cache.
        """
        limit, room = self.max_model_len, self.max_model_len - num_prompt_tokens
        requested = 1 if max_tokens is None else max_tokens
        if num_prompt_tokens + requested > limit:
            completion = "at least 1" if max_tokens is None else str(max_tokens)
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens (max_model_len), but "
                f"{num_prompt_tokens} prompt tokens plus {completion} completion tokens were "
                f"requested ({num_prompt_tokens + requested} tokens). Shorten the prompt or "
                f"lower {max_tokens_param}.",
                max_tokens_param if num_prompt_tokens < limit else param,
            )
        if max_tokens is None:
            default = self.generation_defaults.get("max_tokens")
            max_tokens = room if default is None else min(int(default), room)
        needed = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        if needed > self.max_kv_blocks:
            raise InvalidRequestError(
                f"{param}: {num_prompt_tokens} prompt tokens plus {max_tokens} completion tokens "
                f"need {needed} KV blocks but the cache has {self.max_kv_blocks}; raise "
                f"--kv-cache-memory or lower {max_tokens_param}",
                param,
            )
        return max_tokens
