"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pyxllm.config import EngineConfig
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.outputs import RequestOutput
from pyxllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: ``None`` (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file or a Hugging Face
            directory.
        **kwargs: any other ``EngineConfig`` field (``dtype``, ``max_model_len``,
            ``kv_cache_memory``, ...).

    Raises:
        ValueError: a bad setting or a model that cannot be loaded (the message says which and why).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in the order of ``prompts``.

        Args:
            prompts: text, or ``{"prompt_token_ids": [...]}`` (vLLM's TokensPrompt), or a list of
                them.
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).
        Raises:
            ValueError: an invalid prompt or parameters (nothing is run then).
        """
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        token_ids = [self._tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else p.get("prompt") for p in prompts]
        return self._run(token_ids, texts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}``)
        or several, then generate as ``generate`` does.

        Raises:
            ValueError: malformed messages or a model without a chat template.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        token_ids = [
            tokenizer.apply_chat_template(c, True, **(chat_template_kwargs or {}))
            for c in conversations
        ]
        return self._run(token_ids, [None] * len(token_ids), sampling_params, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.get_tokenizer().encode(prompt)
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return self.get_tokenizer().encode(prompt["prompt"])

    def _run(self, token_ids, texts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params = [params] * len(token_ids) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(token_ids):
            raise ValueError(f"sampling_params: got {len(params)} for {len(token_ids)} prompts")
        engine = self.llm_engine
        for ids, p in zip(token_ids, params):
            engine.validate_request(ids, p)
        request_ids = [str(next(self._ids)) for _ in token_ids]
        for rid, ids, text, p in zip(request_ids, token_ids, texts, params):
            engine.add_request(rid, ids, p, text)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in request_ids]
