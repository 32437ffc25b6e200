"""Batched logits transforms of the sampler, each a plain function over ``[N, vocab]`` float32.

The sampler applies them in vLLM's order: the structured-output bitmask, logit bias and the
``min_tokens`` mask, then the penalties, then temperature, then min-p, top-k and top-p. Each takes
only the rows (or token entries) that use it, so a batch that does not use a feature pays nothing
for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenEntries:
    """Sparse ``(row, token id)`` entries of a ``[N, vocab]`` tensor: ``M`` of them.

    Attributes:
        rows, token_ids: ``[M]`` int64; values: ``[M]`` float32 or ``None`` where the values
            are implied (the ``min_tokens`` mask sets ``-inf``).
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    values: torch.Tensor | None = None


@dataclass(slots=True)
class TokenBitmask:
    """The allowed tokens of ``C`` constrained rows, packed 32 to an int32 word.

    Attributes:
        rows: ``[C]`` int64 rows of the batch.
        bitmask: ``[C, ceil(vocab / 32)]`` int32; bit ``t % 32`` of word ``t // 32`` is set when
            token ``t`` is allowed (the layout of llguidance, xgrammar and vLLM).
    """

    rows: torch.Tensor
    bitmask: torch.Tensor


@dataclass(slots=True)
class Penalties:
    """The penalties of the ``R`` rows that use any, and their token histories.

    Attributes:
        rows: ``[R]`` int64 rows of the batch.
        repetition: ``[R]`` float32 (1.0 = off); presence, frequency: ``[R]`` float32 (0.0 = off).
        prompt_mask: ``[R, vocab]`` bool, the tokens of each row's prompt.
        output_counts: ``[R, vocab]`` float32, how often each token was generated.
    """

    rows: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


def apply_logit_bias(logits: torch.Tensor, bias: TokenEntries) -> torch.Tensor:
    """Add ``bias.values`` to the logits at ``(bias.rows, bias.token_ids)``, in place."""
    return logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, mask: TokenEntries) -> torch.Tensor:
    """Set the logits at ``(mask.rows, mask.token_ids)`` to ``-inf``, in place (``min_tokens``)."""
    return logits.index_put_(
        (mask.rows, mask.token_ids), torch.tensor(float("-inf"), device=logits.device)
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[C, ceil(V / 32)]`` int32 words -> ``[C, V]`` bool, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """Set to ``-inf`` the logits of the tokens ``mask`` does not allow in its rows, in place."""
    allowed = unpack_bitmask(mask.bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    rows = logits.index_select(0, mask.rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, mask.rows, rows)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Apply the repetition, frequency and presence penalties to ``p.rows``, in place.

    As vLLM (and the CTRL paper, Keskar et al. 2019, for repetition): for a token seen in the
    prompt or the output, a positive logit is divided by the repetition penalty and a negative
    one multiplied by it; then ``frequency * count + presence * (count > 0)`` is subtracted,
    with ``count`` the token's occurrences in the output only (OpenAI's definition).
    """
    rows = logits.index_select(0, p.rows)
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = torch.where(seen, p.repetition.unsqueeze(1), 1.0)
    rows = torch.where(rows > 0, rows / rep, rows * rep)
    rows -= p.frequency.unsqueeze(1) * p.output_counts
    rows -= p.presence.unsqueeze(1) * (p.output_counts > 0)
    return logits.index_copy_(0, p.rows, rows)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` the tokens whose probability is below ``min_p`` times the row's largest.

    Args:
        logits: ``[N, vocab]`` float32, already temperature-scaled.
        min_p: ``[N]`` float32 in [0, 1] (0 keeps everything).
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


# A row's top-k / top-p set is first looked for among the tokens within this many (scaled)
# logits of its largest, a band widened 2x while the set may reach past it: sorting a whole
# vocabulary on the CPU is slow (49152 logits: ~3.5 ms for torch.sort), where a compare and a
# sort of the few tokens in the band take ~0.1 ms
TOP_BAND = 8.0


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    band: float = TOP_BAND,
) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p (nucleus, Holtzman et al. 2019) sets to -inf.

    A row's tokens are ranked by logit (equal logits by token id); it keeps ranks below its
    ``top_k``, and of those the ranks whose probability mass before them (softmax over the
    top-k set, in float32) is below its ``top_p``. A row whose top-k is off and ``top_p`` is 1
    keeps every logit (summed in float32, a row's mass can reach 1 before its last tokens).

    On the CPU each row is ranked among the tokens within ``band`` of its largest logit, in
    numpy: those are the first ranks of the whole row, so the set is the same wherever it lies
    among them (no more ranks than its ``top_k``, or a mass reaching its ``top_p``); otherwise
    the band doubles, up to the whole row once it holds a quarter of the vocabulary. Elsewhere
    the rows are sorted whole on the device.

    Args:
        logits: ``[N, vocab]`` float32 (already temperature-scaled).
        top_k: ``[N]`` int64 (``vocab`` where off) or None; top_p: ``[N]`` float32 in (0, 1]
            or None.
        band: the first band's width in logits (a parameter for tests).
    Returns:
        ``[N, vocab]``; at least the most likely token of each row is kept.
    """
    if logits.device.type != "cpu":
        return _top_k_top_p_sorted(logits, top_k, top_p)
    vocab = logits.shape[-1]
    ks = [vocab] * len(logits) if top_k is None else top_k.tolist()
    ps = [1.0] * len(logits) if top_p is None else top_p.tolist()
    rows = logits.numpy()
    out = np.full_like(rows, -np.inf)
    for i, (k, p) in enumerate(zip(ks, ps)):
        if k >= vocab and p >= 1.0:
            out[i] = rows[i]
            continue
        width = band
        while not _top_k_top_p_row(out[i], rows[i], k, p, width):
            width = width * 2 if width < 1e6 else math.inf  # (-inf logits are never in a band)
    return torch.from_numpy(out)


def _top_k_top_p_row(out: np.ndarray, row: np.ndarray, k: int, p: float, width: float) -> bool:
    """Write :func:`apply_top_k_top_p`'s row (``row``'s top-k / top-p set, -inf elsewhere) into
    ``out`` from the tokens within ``width`` of the row's largest logit (the whole row once
    they are a quarter of it, or none: a NaN); ``False`` (``out`` untouched) where the set may
    reach past them."""
    vocab = len(row)
    peak = row.max()
    among = np.flatnonzero(row >= peak - width)
    whole = not 0 < len(among) <= vocab // 4
    if whole:
        among = np.arange(vocab)
    among = among[np.argsort(-row[among], kind="stable")]  # ranked
    values = row[among]
    if k < len(values):
        values = values[:k]
    elif k < vocab and not whole:  # the top-k set reaches past these tokens
        return False
    if p < 1.0:
        exps = np.exp(values - values[0])
        # softmax over the top-k set: among these tokens where it is, else the whole row's
        total = exps.sum() if k <= len(among) else np.exp(row - values[0]).sum()
        probs = exps / total
        mass = np.cumsum(probs)
        if not whole and k > len(among) and mass[-1] < p:
            return False
        kept = (mass - probs) < p
        kept[0] = True  # a top_p that rounds to 0 in float32 still keeps the top token
        values = values[kept]
    out[among[: len(values)]] = values
    return True


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """:func:`apply_top_k_top_p` by sorting each whole row (on an accelerator)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        outside[:, 0] = False  # a top_p that rounds to 0 in float32 still keeps the top token
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    kept = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    keep_all = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
    if top_k is not None:
        keep_all &= top_k >= vocab
    if top_p is not None:
        keep_all &= top_p >= 1.0
    return torch.where(keep_all.unsqueeze(1), logits, kept)


@dataclass(slots=True)
class LogprobsTensors:
    """Log-probabilities of ``L`` rows: each row's given token, then its ``k`` most likely ones.

    Attributes:
        token_ids: ``[L, 1 + k]`` int64; column 0 is the given (sampled or prompt) token.
        logprobs: ``[L, 1 + k]`` float32 natural-log probabilities (``-inf`` for a token the
            sampling settings ruled out).
        ranks: ``[L]`` int64, the given token's 1-based rank (1 + tokens strictly more likely).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def tolists(self) -> list[tuple[list[int], list[float], int]]:
        """Per row ``(token ids, logprobs, rank of the first)``, as Python values."""
        return list(zip(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """Log-softmax of ``logits [L, vocab]``, gathered at ``token_ids [L]`` plus a top-``num_top``.

    One ``topk`` over all rows; rows that asked for fewer keep a prefix of theirs.
    """
    logprobs = logits.log_softmax(dim=-1)
    given = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > given).sum(dim=-1) + 1
    ids, values = token_ids.unsqueeze(1), given
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    return LogprobsTensors(ids, values, ranks)
