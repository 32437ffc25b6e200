"""The step plan the scheduler hands to the executor (vLLM's ``SchedulerOutput``).

Defined here, below the engine, so the executor never imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyxllm.lora_request import LoRARequest
from pyxllm.multimodal_inputs import MultiModalFeatureSpec
from pyxllm.pooling_params import PoolingParams
from pyxllm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's work in a step.

    Attributes:
        request_id: the request it belongs to.
        token_ids: the tokens computed this step: a whole prompt, a chunk of it, or the one
            token sampled last step (decode), followed by ``num_draft_tokens`` speculative
            drafts.
        num_computed_tokens: tokens already in the KV cache, i.e. the position of ``token_ids[0]``.
        block_table: KV block ids covering at least ``num_computed_tokens + len(token_ids)`` tokens.
        sample: whether the step reaches the sequence's last token, so a next token is sampled.
        sampling_params: the request's sampling parameters.
        generator: the request's own random generator when it has a seed, else ``None``.
        num_output_tokens: tokens generated so far (before this step's sample).
        min_tokens_stop_ids: token ids to forbid in this step's sample (EOS and stop token
            ids while the output is shorter than ``min_tokens``), else empty.
        penalty_token_ids: prompt then generated tokens, for repetition/presence/frequency
            penalties; ``None`` when the request uses none (the request's own list, not a copy).
        num_prompt_tokens: where the prompt ends in ``penalty_token_ids``.
        prompt_logprob_targets: for prompt logprobs, the prompt tokens that follow this step's
            positions: ``targets[j]`` is scored by the logits at ``token_ids[j]`` (it may be one
            shorter than ``token_ids``, at the prompt's end); ``None`` when not wanted.
        allowed_token_bitmask: for a structured-output request that samples this step, the
            tokens its constraint allows: ``int32 [ceil(vocab_size / 32)]`` on the CPU, bit
            ``t % 32`` of word ``t // 32`` for token ``t``; with drafts ``int32 [1 + k,
            words]``, row ``j`` for the position after ``j`` drafts; ``None`` when
            unconstrained.
        num_draft_tokens: ``k``, the speculative drafts at the end of ``token_ids`` (0: none);
            the step computes logits at the last ``1 + k`` positions and verifies the drafts.
        pooling_params: an embedding request's (the embed task), ``None`` for generation.
        lora_request: the LoRA adapter its tokens run with, ``None`` for the base model.
        mm_features: the request's images whose placeholder runs overlap this step's tokens
            (the executor encodes those it has not cached and slices each run to the step's
            part); empty for a decode or text.
        mrope_positions: ``int64 [3, len(token_ids)]``, the tokens' mRoPE positions
            (``(temporal, height, width)``, see
            :func:`~pyxllm.multimodal_inputs.mrope_positions`) for a request with images on
            an mRoPE grid (Qwen2-VL), decodes included; ``None``: the tokens' indices.
        bidirectional_ranges: for a model that attends bidirectionally within each image
            (Gemma 3), the ``[start, end)`` prompt positions of the images whose tokens in this
            step see later tokens of their image (each wholly in the step from its first
            token here to its end, which the scheduler ensures); empty otherwise.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    num_output_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    penalty_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    prompt_logprob_targets: list[int] | None = None
    allowed_token_bitmask: torch.Tensor | None = None
    num_draft_tokens: int = 0
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    bidirectional_ranges: tuple[tuple[int, int], ...] = ()

    @property
    def draft_token_ids(self) -> list[int]:
        """The speculative drafts (the last ``num_draft_tokens`` of ``token_ids``)."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


@dataclass(slots=True)
class SchedulerOutput:
    """Every sequence scheduled for one forward pass, and their total number of tokens."""

    sequences: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)
