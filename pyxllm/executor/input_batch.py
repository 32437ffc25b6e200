"""A step's model inputs, built as tensors once per step (never per token in Python)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pyxllm.executor.scheduler_output import SchedulerOutput


def segment_ids(lengths: list[int]) -> torch.Tensor:
    """``int64 [sum(lengths)]``: the segment each element falls in, ``[2, 0, 3] -> [0, 0, 2, 2,
    2]``, as ``repeat_interleave(arange(len(lengths)), lengths)`` gives it; that op's CPU kernel
    opens a parallel region even for a few segments and took ~1 ms a decode step (8 sequences,
    2 threads) where this takes ~5 µs."""
    total = sum(lengths)
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    ends = torch.tensor(list(itertools.accumulate(lengths)), dtype=torch.long)
    return torch.searchsorted(ends, torch.arange(total, dtype=torch.long), right=True)


def _longs(values: list[int]) -> torch.Tensor:
    """``int64 [len(values)]``, by way of numpy (~1 µs against ``torch.tensor``'s ~3-4)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


@dataclass(slots=True)
class InputBatch:
    """Flattened inputs of all scheduled sequences (``B`` sequences, ``T`` tokens in all).

    Attributes:
        input_ids, positions, slot_mapping: ``[T]`` int64.
        query_start_loc: ``[B + 1]`` int64 (``cu_seqlens_q``): sequence ``i``'s tokens are
            ``query_start_loc[i]:query_start_loc[i+1]``.
        seq_lens: ``[B]`` int64 context lengths after this step (cached + new tokens).
        block_tables: ``[B, max_blocks]`` int64, rows padded with block 0.
        logits_indices: ``[N]`` int64 positions in ``T`` whose next token is sampled: a sampled
            sequence's last token, or with ``k`` drafts its last ``1 + k`` tokens, in order.
        query_lens, seq_lens_list, query_start_list: the same as Python lists, for backends.
        num_draft_tokens: ``[B]`` the speculative drafts each sequence verifies (its last
            ``num_draft_tokens`` tokens; 0 for a prefill chunk or a plain decode).
        mrope_positions: ``[3, T]`` int64, the rotary positions of an mRoPE model's step
            where some sequence has them (``ScheduledSequence.mrope_positions``; the others'
            tokens get their position thrice), else ``None``: the model reads ``positions``.
            ``positions`` still places the tokens in the KV cache.
        key_limits: ``[T]`` int64, the last context position each token attends to, where some
            sequence has bidirectional images (``ScheduledSequence.bidirectional_ranges``): a
            token of such an image its image's last position, every other token its own; else
            ``None`` (every token causal, no cost to text-only steps).
        key_limit_seqs: the sequences with such images (indices into the step's sequences).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    query_lens: list[int]
    seq_lens_list: list[int]
    query_start_list: list[int]
    num_draft_tokens: list[int]
    mrope_positions: torch.Tensor | None = None
    key_limits: torch.Tensor | None = None
    key_limit_seqs: tuple[int, ...] = ()

    @classmethod
    def build(cls, plan: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
        """Build the step's tensors from the scheduler's plan; ``block_size`` in tokens.

        Raises:
            ValueError: a sequence's bidirectional image ends after its step's last token (its
                earlier tokens would miss the later ones).
        """
        seqs = plan.sequences
        query_lens = [len(s.token_ids) for s in seqs]
        computed = [s.num_computed_tokens for s in seqs]
        seq_lens = [c + n for c, n in zip(computed, query_lens)]
        starts = [0, *itertools.accumulate(query_lens)]
        # numpy, not torch, for the index arithmetic: a few microseconds an op against torch's
        # ~3-5 (a decode step's ~10 ops were ~3 % of a batch-1 step of the embedded model)
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        seq_idx = np.repeat(np.arange(len(seqs)), query_lens)  # each token's sequence
        offsets = np.array([c - st for c, st in zip(computed, starts)], dtype=np.int64)
        positions = np.arange(starts[-1], dtype=np.int64) + offsets[seq_idx]
        slot_mapping = tables[seq_idx, positions // block_size] * block_size
        slot_mapping += positions % block_size
        sampled = [
            j
            for i, s in enumerate(seqs)
            if s.sample
            for j in range(starts[i + 1] - 1 - s.num_draft_tokens, starts[i + 1])
        ]
        positions = torch.from_numpy(positions)
        mrope = None
        if any(s.mrope_positions is not None for s in seqs):
            mrope = positions.expand(3, -1).clone()
            for i, s in enumerate(seqs):
                if s.mrope_positions is not None:
                    mrope[:, starts[i] : starts[i + 1]] = s.mrope_positions
        limits = None
        limited = tuple(i for i, s in enumerate(seqs) if s.bidirectional_ranges)
        if limited:
            limits = positions.clone()
            for i in limited:
                s, first = seqs[i], computed[i]
                for lo, hi in s.bidirectional_ranges:
                    if hi > seq_lens[i]:
                        raise ValueError(
                            f"sequence {s.request_id}: its image [{lo}, {hi}) ends after the "
                            f"step's last token ({seq_lens[i] - 1})"
                        )
                    lo = max(lo, first)
                    limits[starts[i] + lo - first : starts[i] + hi - first] = hi - 1
        if torch.device(device).type == "cpu":
            to = lambda t: t  # noqa: E731
        else:
            to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        token_ids = itertools.chain.from_iterable(s.token_ids for s in seqs)
        return cls(
            input_ids=to(torch.from_numpy(np.fromiter(token_ids, np.int64, starts[-1]))),
            positions=to(positions),
            slot_mapping=to(torch.from_numpy(slot_mapping)),
            query_start_loc=to(_longs(starts)),
            seq_lens=to(_longs(seq_lens)),
            block_tables=to(torch.from_numpy(tables)),
            logits_indices=to(_longs(sampled)),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            query_start_list=starts,
            num_draft_tokens=[s.num_draft_tokens for s in seqs],
            mrope_positions=None if mrope is None else to(mrope),
            key_limits=None if limits is None else to(limits),
            key_limit_seqs=limited,
        )

    @property
    def decodes_only(self) -> bool:
        """Whether every sequence decodes: one token, or its last token and the drafts it
        verifies (no prefill chunk in the step)."""
        return all(q == 1 + d for q, d in zip(self.query_lens, self.num_draft_tokens))
