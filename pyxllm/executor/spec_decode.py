"""Verifying speculative drafts: which of a sequence's ``k`` proposed tokens the target accepts.

A sequence scheduled with drafts ``d_1..d_k`` after its last token has logits at ``1 + k``
positions; row ``j`` is the target's distribution for output token ``j`` given ``d_1..d_j``. Each
row is sampled as an ordinary step would sample it (:func:`expand_for_verification` gives row
``j`` the penalty history, ``min_tokens`` count and generator of a sequence that already has
``d_1..d_j``), giving the target's own token ``x_j``; the drafts are accepted while ``d_{j+1} ==
x_j``, and the step emits ``d_1..d_a`` then ``x_a``.

This is rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for drafts with a one-hot
proposal distribution ``q`` (the n-gram lookup and the greedy draft model propose one token, not
a distribution): draft ``d`` is accepted with probability ``min(1, p(d) / q(d)) = p(d)``, and on
rejection the token comes from the residual ``max(0, p - q)``, i.e. ``p`` without ``d``,
renormalized; sampling ``x ~ p`` and accepting when ``x == d`` does exactly that (``x == d``
with probability ``p(d)``; otherwise ``x`` is distributed as the residual). So the output
distribution is the target's, and greedy rows give the target's argmax tokens. vLLM's rejection
sampler does the same for one-hot drafts. Drawing ``x`` with the target's own sampler has one
more property: a seeded request's generator is rewound to have drawn one row per *emitted*
token (:class:`GeneratorRewind`), so a seeded request gives the same text with speculation as
without, whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses

from pyxllm.executor.sampler import exponential_draws
from pyxllm.executor.scheduler_output import ScheduledSequence


def expand_for_verification(
    seqs: list[ScheduledSequence],
) -> tuple[list[ScheduledSequence], list[int]]:
    """One sampling row per logits row: ``1 + k`` for a sequence with ``k`` drafts (row ``j``
    samples as if ``d_1..d_j`` were already generated, with its constraint's row ``j``), one for
    any other.

    Returns ``(rows, counts)``: the rows in logits order and how many each sequence has.
    """
    rows, counts = [], []
    for seq in seqs:
        k = seq.num_draft_tokens
        counts.append(1 + k)
        if not k:
            rows.append(seq)
            continue
        drafts, params, bitmask = (
            seq.draft_token_ids,
            seq.sampling_params,
            seq.allowed_token_bitmask,
        )
        for j in range(k + 1):
            produced = seq.num_output_tokens + j
            rows.append(
                dataclasses.replace(
                    seq,
                    num_output_tokens=produced,
                    allowed_token_bitmask=None if bitmask is None else bitmask[j],
                    min_tokens_stop_ids=seq.min_tokens_stop_ids
                    if produced < params.min_tokens
                    else (),
                    penalty_token_ids=None
                    if seq.penalty_token_ids is None
                    else seq.penalty_token_ids + drafts[:j],
                )
            )
    return rows, counts


def accept_drafts(
    seqs: list[ScheduledSequence], counts: list[int], targets: list[int]
) -> list[list[int]]:
    """Each sequence's emitted tokens: its accepted drafts then the target's token after them
    (``targets``: the sampled token of every row, in :func:`expand_for_verification`'s order)."""
    emitted, row = [], 0
    for seq, count in zip(seqs, counts):
        drafted, row = targets[row : row + count], row + count
        accepted = 0
        for draft, target in zip(seq.draft_token_ids, drafted):
            if draft != target:
                break
            accepted += 1
        emitted.append(drafted[: accepted + 1])
    return emitted


class GeneratorRewind:
    """Makes seeded sequences with drafts consume one random row per emitted token.

    The sampler draws one ``[vocab]`` row of exponentials (:func:`exponential_draws`) per
    sampling row from the request's generator; a sequence with ``k`` drafts draws ``1 + k`` but
    may emit fewer. Created before sampling (saving the generators' states), :meth:`rewind`
    restores them and draws as many rows as were emitted, so the generator is where decoding
    without speculation leaves it.
    """

    def __init__(self, seqs: list[ScheduledSequence]) -> None:
        self._saved = {  # greedy rows' tokens do not depend on their draws
            i: seq.generator.get_state()
            for i, seq in enumerate(seqs)
            if seq.num_draft_tokens and seq.generator is not None and not seq.sampling_params.greedy
        }

    def rewind(
        self, seqs: list[ScheduledSequence], emitted: list[list[int]], vocab_size: int
    ) -> None:
        """Reset the saved generators to their states plus ``len(emitted[i])`` rows drawn
        (rows of ``vocab_size`` float32, as the sampler draws them)."""
        for i, state in self._saved.items():
            generator = seqs[i].generator
            generator.set_state(state)
            for _ in emitted[i]:
                exponential_draws((vocab_size,), generator)
