"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pyxllm.config import EngineConfig
from pyxllm.engine.beam_search import BeamSearch
from pyxllm.engine.errors import RequestFailedError
from pyxllm.engine.input_processor import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.entrypoints.chat_media import chat_images
from pyxllm.entrypoints.log_setup import ensure_logging
from pyxllm.entrypoints.openai.chat.reasoning import check_reasoning_parser, reasoning_parser_for
from pyxllm.entrypoints.score_utils import (
    check_cross_encoder,
    cosine_scores,
    distinct_texts,
    score_pairs,
)
from pyxllm.lora_request import LoRARequest
from pyxllm.outputs import (
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pyxllm.pooling_params import POOLING_TASKS, PoolingParams
from pyxllm.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    ``LLM(task="embed")`` embeds instead (:meth:`embed`, :meth:`score`, :meth:`encode`;
    ``model=None`` is then the embedded all-MiniLM-L6-v2; an encoder model embeds under the
    default ``task="auto"``); ``LLM(task="score")`` scores text pairs with a cross-encoder
    (:meth:`score`) and ``LLM(task="classify")`` classifies (:meth:`classify`), each chosen by
    ``task="auto"`` for a ``*ForSequenceClassification`` model of one label or several.

    Args:
        model: ``None`` (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file, a Hugging Face
            directory or a Hugging Face model id ``ORG/NAME``.
        reasoning_parser: a reasoning parser's name (the server's ``--reasoning-parser``
            choices, e.g. ``"qwen3"``; vLLM's engine argument): a request with a
            ``thinking_token_budget`` and no think tags of its own takes the parser's.
        **kwargs: any other ``EngineConfig`` field (``tokenizer``, ``gguf_file``, ``revision``,
            ``dtype``, ``max_model_len``, ``kv_cache_memory``, ...), also under vLLM's names
            (``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
            ``kv_cache_memory_bytes``; see :meth:`EngineConfig.from_kwargs`).

    Raises:
        TypeError: an unknown keyword, or one setting under two names.
        ValueError: a bad setting (an unknown ``reasoning_parser`` among them) or a model that
            cannot be loaded (the message says which and why).
    """

    def __init__(
        self, model: str | None = None, reasoning_parser: str | None = None, **kwargs: Any
    ) -> None:
        check_reasoning_parser(reasoning_parser)  # an unknown name fails before loading
        ensure_logging()  # the loading lines, as vLLM's LLM prints them
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        _, self._reasoning = reasoning_parser_for(reasoning_parser, self.llm_engine.tokenizer)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in the order of ``prompts``.

        Args:
            prompts: text, or ``{"prompt_token_ids": [...]}`` (vLLM's TokensPrompt, optionally
                with its ``"prompt"`` text), or ``{"prompt": text}``, or a list of them.
            sampling_params: one for all prompts, or one per prompt (default:
                ``SamplingParams()``); fields left unset take the model's generation_config.json
                values, as in the server.
            lora_request: the LoRA adapter to run with (``LLM(enable_lora=True)``), one for
                all prompts or one per prompt (``None``: the base model); loaded on first use.
        Raises:
            ValueError: an invalid prompt or parameters, or an adapter that cannot be served
                (nothing is run then).
        """
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run([_as_prompt(p) for p in prompts], sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search from every prompt (vLLM's ``LLM.beam_search``; the rules are
        transformers', see :mod:`pyxllm.engine.beam_search`): each step runs every live beam of
        every prompt as a one-token request in one batch, the prefix cache sharing their
        common blocks. Outputs come back in the order of ``prompts``, each with
        ``params.beam_width`` sequences, best first; a sequence's ``tokens`` hold the prompt
        and ``text`` is their decoded text (special tokens skipped).

        Args:
            prompts: as :meth:`generate` takes them.
            params: the search's :class:`~pyxllm.sampling_params.BeamSearchParams`.

        Raises:
            ValueError: an invalid prompt, a prompt plus ``max_tokens`` that do not fit the
                context, or a ``beam_width`` too large (nothing is run then).
        """
        self._require_generate("beam_search")
        engine = self.llm_engine
        processor, tokenizer = engine.input_processor, engine.tokenizer
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        first = SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        searches = [
            BeamSearch(
                processor.process(str(next(self._ids)), prompt, first).prompt_token_ids,
                params,
                tokenizer.eos_token_ids,
            )
            for prompt in map(_as_prompt, prompts)
        ]
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            while pending := [(s, s.pending()) for s in searches if not s.done]:
                requests = [
                    processor.process(str(next(self._ids)), TokensPrompt(tokens), s.step_params)
                    for s, beams in pending
                    for tokens in beams
                ]
                outputs = iter(self._drain(requests, False, "Beam search"))
                for search, beams in pending:
                    search.advance([next(outputs).outputs[0].logprobs[0] for _ in beams])
                bar.update(1)
        return [search.result(tokenizer.decode) for search in searches]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Embed every prompt, batched (an ``LLM(task="embed")``); outputs come back in the
        order of ``prompts``, each vector in ``output.outputs.embedding`` (a list) and
        ``output.outputs.data`` (``float32 [dimensions]``).

        Args:
            prompts: text or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": text}``), or a
                list of them; text gets the tokenizer's special tokens (BERT's ``[CLS]`` and
                ``[SEP]``).
            pooling_params: ``dimensions`` and ``normalize`` for all prompts.
            truncate_prompt_tokens: keep at most this many tokens of each prompt (``-1``:
                ``max_model_len``), as ``/v1/embeddings``' field.

        Raises:
            ValueError: an engine that does not embed, or an invalid prompt or parameters
                (nothing is run then).
        """
        self._check_task("embed", ("embed",), "task='embed' and an embedding model")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "Embedding")

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """The model's pooled output of every prompt, batched (vLLM's ``LLM.encode``, what
        ``/pooling`` answers; any pooling task): an embedding model's embedding (as
        :meth:`embed`), a classifier's activated outputs (as :meth:`classify`'s ``probs``), in
        ``output.outputs.data``.

        Raises:
            ValueError: an engine that does not pool, or an invalid prompt or parameters.
        """
        self._check_task("encode", POOLING_TASKS, "a pooling task: embed, score or classify")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "Encoding")

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """Classify every prompt, batched (an ``LLM(task="classify")`` or ``"score"``): each
        output's ``outputs.probs`` holds one value per class (softmax over the logits for
        several labels), as ``/classify`` gives them; the label names are the model's
        ``id2label``, in ``llm_engine.input_processor.class_labels``.

        Raises:
            ValueError: an engine that does not classify, or an invalid prompt.
        """
        self._check_task("classify", ("score", "classify"), "a *ForSequenceClassification model")
        outputs = self._pool(prompts, None, truncate_prompt_tokens, use_tqdm, "Classifying")
        return [
            ClassificationRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                ClassificationOutput(out.outputs.data.tolist()),
            )
            for out in outputs
        ]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}``)
        or several, then generate as ``generate`` does (``lora_request`` likewise).

        A vision-language model takes images as content parts, vLLM's forms:
        ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or a
        ``file://`` URL under ``allowed_local_media_path``) and ``{"type": "image_pil",
        "image_pil": <PIL image>}`` (see :mod:`pyxllm.entrypoints.chat_media`).

        Raises:
            ValueError: malformed messages, a model without a chat template, or an image part
                refused (``InvalidRequestError`` naming ``messages[i].content[j]``).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        processor = self.llm_engine.input_processor
        template = getattr(self.get_tokenizer().hf, "chat_template", None)
        prompts = []
        for conversation in conversations:
            rendered, mm_data = chat_images(conversation, processor, template)
            prompts.append(ChatPrompt(rendered, True, kwargs, mm_data))
        return self._run(
            prompts,
            sampling_params,
            use_tqdm,
            lora_request,
        )

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs: ``text_1`` against each of ``text_2`` (or the reverse), or two
        lists of one length pairwise; each score (``output.outputs.score``) is, as ``/v1/score``
        gives it, with a cross-encoder (``LLM(task="score")``) its output for the pair (one
        forward each, the pair tokenized as the tokenizer pairs texts), with an embedding model
        (``LLM(task="embed")``) the cosine similarity of the two texts' embeddings (each
        distinct text embedded once).

        Raises:
            ValueError: an engine that neither embeds nor scores, a classifier of several
                labels, an empty text or list, or lists of different lengths
                (``InvalidRequestError``, naming ``text_1`` or ``text_2``).
        """
        self._check_task("score", POOLING_TASKS, "task='score' and a cross-encoder")
        text_1 = text_1 if isinstance(text_1, str) else list(text_1)
        text_2 = text_2 if isinstance(text_2, str) else list(text_2)
        pairs = score_pairs(text_1, text_2)
        processor = self.llm_engine.input_processor
        if self.llm_engine.config.task != "embed":
            check_cross_encoder(processor.class_labels, "score")
            requests = [
                processor.process_pooling(
                    str(next(self._ids)), pair, None, truncate_prompt_tokens, param="text_2"
                )
                for pair in pairs
            ]
            return [
                ScoringRequestOutput(
                    out.request_id, out.prompt_token_ids, ScoringOutput(float(out.outputs.data[0]))
                )
                for out in self._drain(requests, use_tqdm, "Scoring")
            ]
        texts = distinct_texts(pairs)
        outputs = self.embed(texts, None, truncate_prompt_tokens, use_tqdm)
        vectors = {text: out.outputs.data for text, out in zip(texts, outputs)}
        ids = {text: out.prompt_token_ids for text, out in zip(texts, outputs)}
        return [
            ScoringRequestOutput(str(next(self._ids)), ids[a] + ids[b], ScoringOutput(score))
            for (a, b), score in zip(pairs, cosine_scores(pairs, vectors))
        ]

    def _check_task(self, method: str, tasks: tuple[str, ...], needs: str) -> None:
        """Raise ``ValueError`` naming ``method`` when the engine's task is not in ``tasks``."""
        task = self.llm_engine.config.task
        if task not in tasks:
            raise ValueError(f"{method}: this LLM runs task {task!r}; create it with {needs}")

    def _pool(
        self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm: bool, desc: str
    ) -> list[PoolingRequestOutput]:
        """Run every prompt as a pooling request (see :meth:`embed`'s arguments)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        processor = self.llm_engine.input_processor
        requests = []
        for prompt in map(_as_prompt, prompts):
            item = prompt.text if isinstance(prompt, TextPrompt) else prompt
            requests.append(
                processor.process_pooling(
                    str(next(self._ids)), item, pooling_params, truncate_prompt_tokens
                )
            )
        return self._drain(requests, use_tqdm, desc)

    def _run(
        self, prompts: list[Prompt], sampling_params, use_tqdm: bool, lora_request=None
    ) -> list[RequestOutput]:
        self._require_generate("generate")
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        params = [self._with_think_tags(p) for p in params]
        loras = lora_request
        if loras is None or isinstance(loras, LoRARequest):
            loras = [loras] * len(prompts)
        loras = list(loras)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        engine = self.llm_engine
        for lora in {lora for lora in loras if lora is not None}:  # a bad adapter runs nothing
            engine.add_lora(lora)
        requests = [
            engine.input_processor.process(str(next(self._ids)), prompt, p, lora_request=lora)
            for prompt, p, lora in zip(prompts, params, loras)
        ]
        for request in requests:  # every constraint compiles before anything runs
            grammar = engine.input_processor.constraint(request)
            if grammar is not None:
                grammar.compiled()
        return self._drain(requests, use_tqdm, "Generating")

    def _with_think_tags(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the reasoning parser's think tags where it has a thinking budget
        and no tags of its own (as the server fills them)."""
        if (
            self._reasoning is None
            or params.thinking_token_budget is None
            or params.think_end_token_ids
        ):
            return params
        return params.replace(
            think_start_token_ids=self._reasoning.start_token_ids(),
            think_end_token_ids=self._reasoning.end_token_ids(),
        )

    def _require_generate(self, method: str) -> None:
        """Raise ValueError (naming ``method``) unless this LLM generates text."""
        self._check_task(
            method,
            ("generate",),
            "a generative model (use embed(), score(), classify() or encode())",
        )

    def _drain(self, requests: list, use_tqdm: bool, desc: str) -> list:
        """Add the processed ``requests`` and step until all finish; their final outputs in
        order (a failed request aborts the others and raises ``RequestFailedError``)."""
        engine = self.llm_engine
        for request in requests:
            engine.add_request(request)
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with tqdm(total=len(requests), desc=desc, disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                for request_id, exc in engine.pop_failures().items():
                    for other in requests:
                        engine.abort_request(other.request_id)
                    raise RequestFailedError(f"request {request_id} failed: {exc!r}") from exc
        return [finished[r.request_id] for r in requests]


def _as_prompt(prompt: PromptType) -> Prompt:
    """vLLM's prompt forms as an input-processor prompt: text, ``{"prompt": text}`` or
    ``{"prompt_token_ids": ids}`` (with an optional ``"prompt"`` text); either with
    ``"multi_modal_data": {"image": PIL image or list}`` for a vision-language model."""
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    mm_data = prompt.get("multi_modal_data")
    if "prompt_token_ids" in prompt:
        return TokensPrompt(
            prompt["prompt_token_ids"], prompt.get("prompt"), multi_modal_data=mm_data
        )
    return TextPrompt(prompt["prompt"], multi_modal_data=mm_data)
