"""A thinking-token budget (vLLM's ``thinking_token_budget``, llama.cpp's ``--reasoning-budget``).

A request with ``SamplingParams.thinking_token_budget = N`` may write at most ``N`` reasoning
tokens: once its output holds ``N`` of them and its reasoning has not ended, each next step is
forced to the next token of ``think_end_token_ids`` (``</think>``) until the tag is complete;
then the model writes its answer freely.

Counting: the reasoning tokens are the output tokens before the end tag, less a leading
``think_start_token_ids`` (``<think>``, when the model writes it itself: it is a tag, not
reasoning). Forcing starts once ``N`` of them were written; if the output then ends with the
first tokens of a several-token end tag (the model began closing), forcing continues that tag
rather than starting it again. So with a budget of ``N`` the text between the tags is exactly
``N`` tokens, unless the model closed (or began to close) its thinking before.

Forcing is a one-token bitmask row (:func:`forced_token_bitmask`) on the request's sample,
the row the structured-output path already hands the sampler: the sampler masks that row's
logits to the forced token, after the forward pass, so every runner (eager, compiled, graph)
gives the same tokens and no other row of the batch changes (batch invariance). Overriding the
sampled token instead would need a second path through the sampler (logprobs, speculative
verification); the mask keeps one. The forced token's logprob is then 0 (the masked
distribution's), as for any constrained token. The budget applies only while the reasoning
runs, and a structured-output constraint only after it (``Request.constrain_after``), so the
two never mask the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ThinkingBudget:
    """One request's budget and whether its reasoning has ended.

    Attributes:
        budget: the most reasoning tokens (>= 0).
        start_ids: the tag opening the reasoning (may be empty: the prompt opened it).
        end_ids: the tag closing it (not empty).
        ended: the output has written ``end_ids`` (forced or not): nothing more to force.
    """

    budget: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    ended: bool = False

    def observe(self, tail: Sequence[int]) -> None:
        """Note the output's newest token: ``tail`` is the output's last tokens (the last
        ``len(end_ids)`` of them, or all while it is shorter; never prompt tokens)."""
        n = len(self.end_ids)
        if not self.ended and tuple(tail[-n:]) == self.end_ids:
            self.ended = True

    def num_reasoning(self, token_ids: Sequence[int], first: int = 0) -> int:
        """Output tokens counted against the budget while the reasoning runs (a partial end
        tag included; see the module's counting rule). The output is ``token_ids[first:]``
        (a request passes its prompt and output, uncopied)."""
        head = tuple(token_ids[first : first + len(self.start_ids)])
        skip = len(head) if head and self.start_ids[: len(head)] == head else 0
        return len(token_ids) - first - skip

    def forced_token(self, token_ids: Sequence[int], first: int = 0) -> int | None:
        """The token the next step must sample (the end tag's next one), or ``None`` when the
        model samples freely (reasoning ended or budget not reached); the output is
        ``token_ids[first:]``."""
        if self.ended or self.num_reasoning(token_ids, first) < self.budget:
            return None
        return self.end_ids[self._partial_end(token_ids, first)]

    def room(self, token_ids: Sequence[int], first: int = 0) -> int | None:
        """Tokens the model may still sample before forcing starts (0 while forcing), ``None``
        when the reasoning ended: how many tokens a speculative step may emit; the output is
        ``token_ids[first:]``."""
        if self.ended:
            return None
        return max(0, self.budget - self.num_reasoning(token_ids, first))

    def _partial_end(self, token_ids: Sequence[int], first: int) -> int:
        """Length of the longest proper prefix of the end tag that the output ends with."""
        for m in range(min(len(self.end_ids) - 1, len(token_ids) - first), 0, -1):
            if tuple(token_ids[len(token_ids) - m :]) == self.end_ids[:m]:
                return m
        return 0


def forced_token_bitmask(token_id: int, vocab_size: int) -> torch.Tensor:
    """The structured-output bitmask row allowing ``token_id`` alone: ``int32 [ceil(vocab_size
    / 32)]``, bit ``t % 32`` of word ``t // 32`` for token ``t``."""
    row = torch.zeros(-(-vocab_size // 32), dtype=torch.int32)
    bit = 1 << (token_id % 32)
    row[token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # as an int32
    return row
