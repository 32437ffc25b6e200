"""Batched sampling: logits of every sampled sequence in, one token id per sequence out.

Random draws use the exponential-race form of categorical sampling (``argmax(p / q)`` with
``q ~ Exp(1)``, as vLLM's sampler does), so a seeded request draws its ``q`` row from its own
generator and gets the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pyxllm.executor.scheduler_output import ScheduledSequence


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors (``N`` sampled sequences).

    Attributes:
        all_greedy: every row is greedy (only an argmax is needed).
        greedy: ``[N]`` bool; temperature: ``[N]`` float32 (1.0 on greedy rows);
        top_p: ``[N]`` float32 or None when no row uses it; top_k: ``[N]`` int64 (vocab size when
            off) or None when no row uses it; generators: row -> the request's own generator.
    """

    all_greedy: bool
    greedy: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    generators: dict[int, torch.Generator]

    @classmethod
    def build(cls, seqs: list[ScheduledSequence], vocab_size: int, device: torch.device) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        greedy = [p.greedy for p in params]
        top_p = [p.top_p for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            all_greedy=all(greedy),
            greedy=torch.tensor(greedy, device=device),
            temperature=torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device),
            top_p=torch.tensor(top_p, device=device) if any(p < 1.0 for p in top_p) else None,
            top_k=torch.tensor(top_k, device=device) if any(k < vocab_size for k in top_k) else None,
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None},
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p (nucleus, Holtzman et al. 2019) sets to -inf.

    Args:
        logits: ``[N, vocab]`` float32 (already temperature-scaled).
        top_k: ``[N]`` int64 or None; top_p: ``[N]`` float32 in (0, 1] or None.
    Returns:
        ``[N, vocab]``; at least the most likely token of each row is kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


class Sampler:
    """Turns ``[N, vocab]`` float32 logits into ``[N]`` int64 token ids.

    ``generator`` drives the rows of requests without a seed (seeded by ``--seed``).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_ids
        scaled = logits / meta.temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        sampled = probs.div_(q).argmax(dim=-1)
        return torch.where(meta.greedy, greedy_ids, sampled)
