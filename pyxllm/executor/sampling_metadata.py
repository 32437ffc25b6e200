"""One step's sampling settings as tensors, built once per step from the scheduled sequences.

Each optional feature's tensors are ``None`` when no row of the batch uses it, so an all-greedy
batch without penalties, biases or logprobs builds no tensor at all (after a decode step has
streamed the weights through the caches each small tensor costs ~10 us).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pyxllm.executor.input_batch import segment_ids
from pyxllm.executor.logits_processors import Penalties, TokenBitmask, TokenEntries
from pyxllm.executor.scheduler_output import ScheduledSequence


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors (``N`` sampled sequences).

    Attributes:
        all_greedy: every row is greedy (only an argmax is needed).
        greedy: ``[N]`` bool; temperature: ``[N]`` float32 (1.0 on greedy rows); both None when
            all rows are greedy.
        top_p: ``[N]`` float32 or None when no row uses it; top_k: ``[N]`` int64 (vocab size when
            off) or None; min_p: ``[N]`` float32 or None. Greedy rows have them off, so their
            logprobs are of the whole (biased, penalized) distribution.
        generators: row -> the request's own generator.
        allowed_tokens: the structured-output rows' bitmasks, or None.
        logit_bias: the bias entries of every row, or None.
        min_tokens_mask: the (row, token) entries forbidden by ``min_tokens``, or None.
        penalties: the rows with penalties and their token counts, or None.
        logprob_rows: ``[L]`` int64 rows that asked for logprobs, or None; num_logprobs: the
            number of top logprobs each of them asked for (``L`` ints); max_num_logprobs: their max.
    """

    all_greedy: bool
    greedy: torch.Tensor | None
    temperature: torch.Tensor | None
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    generators: dict[int, torch.Generator]
    min_p: torch.Tensor | None = None
    allowed_tokens: TokenBitmask | None = None
    logit_bias: TokenEntries | None = None
    min_tokens_mask: TokenEntries | None = None
    penalties: Penalties | None = None
    logprob_rows: torch.Tensor | None = None
    num_logprobs: list[int] | None = None
    max_num_logprobs: int = 0

    @classmethod
    def build(
        cls, seqs: list[ScheduledSequence], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """The metadata of ``seqs`` (one row each) for logits of ``vocab_size`` columns."""
        params = [s.sampling_params for s in seqs]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        off = [
            (1.0, vocab_size, 0.0)
            if g
            else (p.top_p, p.top_k if 0 < p.top_k < vocab_size else vocab_size, p.min_p)
            for g, p in zip(greedy, params)
        ]
        top_p, top_k, min_p = zip(*off)
        meta = cls(
            all_greedy=all_greedy,
            greedy=None if all_greedy else torch.tensor(greedy, device=device),
            temperature=None
            if all_greedy
            else torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device
            ),
            top_p=None
            if all_greedy or all(v >= 1.0 for v in top_p)
            else torch.tensor(top_p, device=device),
            top_k=None
            if all_greedy or all(k >= vocab_size for k in top_k)
            else torch.tensor(top_k, device=device),
            min_p=None
            if all_greedy or not any(min_p)
            else torch.tensor(min_p, dtype=torch.float32, device=device),
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None},
        )
        constrained = [i for i, s in enumerate(seqs) if s.allowed_token_bitmask is not None]
        if constrained:
            bitmask = torch.stack([seqs[i].allowed_token_bitmask for i in constrained])
            meta.allowed_tokens = TokenBitmask(torch.tensor(constrained, device=device), bitmask)
        if any(p.logit_bias for p in params):
            meta.logit_bias = _bias_entries(params, device)
        if any(s.min_tokens_stop_ids for s in seqs):
            entries = [(i, t) for i, s in enumerate(seqs) for t in s.min_tokens_stop_ids]
            rows, ids = zip(*entries)
            meta.min_tokens_mask = TokenEntries(
                torch.tensor(rows, device=device), torch.tensor(ids, device=device)
            )
        if any(s.penalty_token_ids is not None for s in seqs):
            meta.penalties = _penalties(seqs, vocab_size, device)
        asked = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            rows, counts = zip(*asked)
            meta.logprob_rows = torch.tensor(rows, device=device)
            meta.num_logprobs, meta.max_num_logprobs = list(counts), max(counts)
        return meta


def _bias_entries(params, device: torch.device) -> TokenEntries:
    entries = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    rows, ids, values = zip(*entries)
    return TokenEntries(
        torch.tensor(rows, device=device),
        torch.tensor(ids, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _penalties(seqs: list[ScheduledSequence], vocab_size: int, device: torch.device) -> Penalties:
    """Count the prompt and output tokens of the rows with penalties (one scatter each)."""
    rows = [i for i, s in enumerate(seqs) if s.penalty_token_ids is not None]
    histories = [seqs[i].penalty_token_ids for i in rows]
    splits = [seqs[i].num_prompt_tokens for i in rows]
    prompts = [h[:n] for h, n in zip(histories, splits)]
    outputs = [h[n:] for h, n in zip(histories, splits)]

    def index(parts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        row = segment_ids([len(x) for x in parts])
        ids = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long)
        return row.to(device, non_blocking=True), ids.to(device, non_blocking=True)

    prompt_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    prompt_mask[index(prompts)] = True
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_(index(outputs), torch.ones((), device=device), accumulate=True)
    params = [seqs[i].sampling_params for i in rows]
    return Penalties(
        rows=torch.tensor(rows, device=device),
        repetition=torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=device
        ),
        presence=torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32, device=device
        ),
        frequency=torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=device
        ),
        prompt_mask=prompt_mask,
        output_counts=counts,
    )
