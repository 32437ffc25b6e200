"""Where a step's speculative drafts come from: prompt lookup here, or slots for the draft model.

:class:`NgramProposer` is prompt-lookup (n-gram) drafting (vLLM's ``NgramProposer``):
for a sequence (prompt plus output so far) it finds the longest suffix of ``n`` tokens,
``prompt_lookup_min <= n <= prompt_lookup_max``, that also occurs earlier, and proposes the up
to ``k`` tokens that followed its most recent earlier occurrence. Text that copies from its
context (a rewrite, an edit of given code, a quote) continues the way the context did, so the
drafts are often right. The search is vectorized with numpy: one comparison of every window of
the sequence with the suffix per ``n``, no Python loop over the tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to ``k`` draft tokens per sequence by prompt lookup.

    Args:
        k: tokens proposed at most (``num_speculative_tokens``).
        min_n / max_n: the suffix lengths tried, longest first (``prompt_lookup_min`` /
            ``prompt_lookup_max``).
    """

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """The draft for a sequence ``token_ids``: up to ``min(k, max_tokens)`` tokens, empty
        when no suffix of ``min_n`` or more tokens occurred before."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        if limit <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself and are followed by a token
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's continuation
                return tokens[start : start + limit].tolist()
        return []


class DraftModelSlots:
    """Reserves ``k`` draft positions per decoding sequence for the draft model, which runs in
    the executor and fills them (:mod:`pyxllm.executor.draft_model`); the placeholders repeat
    the sequence's last token."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """``min(k, max_tokens)`` placeholders."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        return [token_ids[-1]] * max(limit, 0)
