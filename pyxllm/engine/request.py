"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pyxllm.engine.detokenizer import IncrementalDetokenizer
from pyxllm.engine.structured_output import GrammarMatcher
from pyxllm.engine.thinking_budget import ThinkingBudget
from pyxllm.lora_request import LoRARequest
from pyxllm.multimodal_inputs import MultiModalFeatureSpec, mrope_positions
from pyxllm.outputs import PromptLogprobs, SampleLogprobs
from pyxllm.pooling_params import PoolingParams
from pyxllm.sampling_params import FULL_VOCAB_LOGPROBS, SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: waiting (new or preempted), running, or finished (and why)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """One request: its tokens so far, how many of them are in the KV cache, and its output state.

    Attributes:
        token_ids: prompt followed by every generated token (the sequence the KV cache holds).
        num_computed_tokens: leading tokens of ``token_ids`` whose K/V are cached.
        generator: the request's own random generator when its params carry a seed.
        block_hashes: prefix-cache hashes of its leading full blocks (kept across preemption).
        first_token_time / last_token_time: ``time.monotonic()`` seconds when it got its first
            and latest token (``None`` before), like ``arrival_time``.
        index: which of its parent request's ``n`` completions this is (0 when ``n`` is 1).
        min_tokens_stop_ids: token ids forbidden until ``min_tokens`` tokens were generated
            (EOS unless ``ignore_eos``, and ``stop_token_ids``); empty without ``min_tokens``.
        logprobs / prompt_logprobs: collected per generated / prompt token when asked for.
        prompt_logprob_rows: with ``prompt_logprobs=-1`` (the whole vocabulary), the
            log-softmax rows collected so far instead: ``float32 [rows, vocab_size]`` chunks,
            one per prefill step, row ``j`` of all of them scoring prompt token ``j + 1``.
        matcher: the request's structured-output matcher (advanced by each generated token),
            ``None`` without a constraint.
        constrain_after: while the output has not yet ended with these token ids (the end of
            the reasoning), the matcher waits: no mask, no tokens fed; then it is emptied.
        spec_token_ids: draft tokens proposed for the next step (speculative decoding), not
            part of ``token_ids`` until the target model accepts them.
        num_cached_tokens: prompt tokens its first scheduling found in the prefix cache
            (``None`` before; a preempted request keeps its first figure, as in vLLM).
        pooling_params: an embedding request's (the embed task: it ends after its prefill with
            a pooled vector, see ``LLMEngine``); ``None`` for generation.
        thinking: its thinking-token budget (``thinking_token_budget``), ``None`` without one.
        lora_request: the LoRA adapter it runs with (``--enable-lora``), ``None`` for the base
            model; its KV blocks are cached under the adapter (:attr:`prefix_cache_salt`).
        mm_features: its images (placeholder runs, pixel values, content hashes), in prompt
            order; empty for text.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None for an embedding request
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    first_token_time: float | None = None
    last_token_time: float | None = None
    index: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    logprobs: SampleLogprobs | None = field(default=None, repr=False)
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)
    prompt_logprob_rows: list[torch.Tensor] | None = field(default=None, repr=False)
    matcher: GrammarMatcher | None = field(default=None, repr=False)
    constrain_after: tuple[int, ...] = ()
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    num_cached_tokens: int | None = None
    pooling_params: PoolingParams | None = None
    thinking: ThinkingBudget | None = field(default=None, repr=False)
    lora_request: LoRARequest | None = None
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        if params.thinking_token_budget is not None:
            self.thinking = ThinkingBudget(
                params.thinking_token_budget,
                params.think_start_token_ids,
                params.think_end_token_ids,
            )
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed % 2**64)
        if params.logprobs is not None:
            self.logprobs = []
        if params.prompt_logprobs == FULL_VOCAB_LOGPROBS:
            self.prompt_logprob_rows = []
        elif params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_logprobs_recorded(self) -> int:
        """Leading prompt tokens whose logprobs are recorded, the first one counted (it has
        none to record); 0 when the request asked for none."""
        if self.prompt_logprob_rows is not None:
            return 1 + sum(len(rows) for rows in self.prompt_logprob_rows)
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt token still lacks its logprobs (its prefill must compute
        logits at every prompt position, so it takes no prefix-cache hit)."""
        wanted = self.prompt_logprobs is not None or self.prompt_logprob_rows is not None
        return wanted and self.num_prompt_logprobs_recorded < self.num_prompt_tokens

    def prompt_logprobs_tensor(self) -> torch.Tensor | None:
        """The collected :attr:`prompt_logprob_rows` as one ``float32 [num_prompt_tokens - 1,
        vocab_size]`` tensor once the prompt is computed (joined once, then kept); ``None``
        without ``prompt_logprobs=-1`` or for a one-token prompt."""
        rows = self.prompt_logprob_rows
        if not rows:
            return None
        if len(rows) > 1:
            self.prompt_logprob_rows = rows = [torch.cat(rows)]
        return rows[0]

    @property
    def constrained(self) -> bool:
        """Whether the request's constraint applies to its next token."""
        return self.matcher is not None and not self.constrain_after

    def forced_token(self) -> int | None:
        """The token its next sample must be (the thinking budget is spent: the end of the
        reasoning), ``None`` when it samples freely."""
        if self.thinking is None or self.thinking.ended:
            return None
        return self.thinking.forced_token(self.token_ids, self.num_prompt_tokens)

    def thinking_room(self) -> int | None:
        """Tokens it may sample before its thinking budget forces the end of the reasoning
        (0 while forcing), ``None`` when no budget limits it (speculation must not cross it)."""
        if self.thinking is None or self.thinking.ended:
            return None
        return self.thinking.room(self.token_ids, self.num_prompt_tokens)

    def accept_token(self, position: int) -> bool:
        """Advance the constraint past the generated token at ``token_ids[position]`` (or,
        before it applies, watch for the end of the reasoning); ``False`` when the token broke
        the constraint. The thinking budget notes the token too."""
        if self.thinking is not None and not self.thinking.ended:
            n = len(self.thinking.end_ids)
            start = max(self.num_prompt_tokens, position + 1 - n)
            self.thinking.observe(self.token_ids[start : position + 1])
        if self.matcher is None:
            return True
        if self.constrain_after:
            start = max(0, position + 1 - len(self.constrain_after))
            if self._ends_reasoning(self.token_ids[start : position + 1]):
                self.constrain_after = ()
            return True
        if self.matcher.is_terminated():  # complete: only EOS follows (kept with ignore_eos)
            return True
        return self.matcher.accept_token(self.token_ids[position])

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of speculative ``drafts`` that the constraint lets the step verify.

        Under a constraint, the drafts it allows (vLLM #49694: a draft the grammar refuses must
        not reach verification). While the reasoning runs (``constrain_after``), the drafts
        before the one that would end it: the token after the end is constrained, and the
        step's rows for drafts carry no mask, so the run must not cross the end.
        """
        if self.matcher is None or not drafts:
            return drafts
        if not self.constrain_after:
            return drafts[: self.matcher.validate_tokens(drafts)]
        n = len(self.constrain_after)
        context = self.token_ids[len(self.token_ids) - n + 1 :] if n > 1 else []
        for i in range(len(drafts)):
            if self._ends_reasoning(context + drafts[: i + 1]):
                return drafts[:i]
        return drafts

    def _ends_reasoning(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` end with the end of the reasoning (``constrain_after``)."""
        n = len(self.constrain_after)
        return len(tokens) >= n and tuple(tokens[-n:]) == self.constrain_after

    @property
    def prefix_cache_salt(self) -> bytes | None:
        """What its first block's prefix-cache hash chains from: the adapter's salt, so no
        two adapters (or an adapter and the base model) share a block; ``None`` for the base."""
        return None if self.lora_request is None else self.lora_request.prefix_cache_salt

    def block_extra_keys(self, start: int, end: int) -> bytes:
        """What a KV block over tokens ``[start, end)`` adds to its prefix-cache hash: the
        content hashes of the images whose placeholder runs it overlaps (empty: none)."""
        return b"".join(
            f.identifier.encode() for f in self.mm_features if f.overlap(start, end) is not None
        )

    def mm_features_in(self, start: int, end: int) -> list[MultiModalFeatureSpec]:
        """Its images whose placeholder runs overlap the tokens ``[start, end)``."""
        return [f for f in self.mm_features if f.overlap(start, end) is not None]

    def mrope_positions_in(self, start: int, end: int) -> torch.Tensor | None:
        """The mRoPE positions ``int64 [3, end - start]`` of its tokens ``[start, end)`` (see
        :func:`~pyxllm.multimodal_inputs.mrope_positions`); ``None`` when none of its images
        has an mRoPE grid (text, or a model with 1-D positions: the step's positions are the
        tokens' indices)."""
        if not any(f.mrope_grid is not None for f in self.mm_features):
            return None
        return mrope_positions(self.mm_features, start, end)

    @property
    def max_tokens(self) -> int:
        """New tokens allowed (the processed params' ``max_tokens``, always an int)."""
        return self.sampling_params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
