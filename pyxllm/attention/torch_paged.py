"""The pure-PyTorch paged attention backend (every platform's fallback, CPU's default).

Per step it splits the batch into decode sequences (one new token: batched together) and
prefill sequences (a prompt or a chunk of one, over any cached prefix: one call each), so a
batch may mix both in any order.

A step whose tokens carry key limits (``InputBatch.key_limits``: the tokens of an image a model
attends bidirectionally, Gemma 3's) hands each prefill its tokens' limits, and the decode kernel
its rows' (a prefill's tokens under ``--batch-invariant``) as ``key_lens``: the CPU's fused
kernel reads them as it reads the rows' lengths, a row's sums over its own keys whatever the
other rows; the native one builds its mask from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyxllm import kernels
from pyxllm.kernels import native


@dataclass(slots=True)
class PrefillSpan:
    """One prefill sequence of the step: its tokens ``[start, end)`` and context length after
    them."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor
    key_limits: torch.Tensor | None = None  # [end - start] int64, see paged_attention_prefill


@dataclass(slots=True)
class TorchPagedAttentionStep:
    """Attention metadata of one step, with the ``forward`` that attention layers call.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token (negative: padding).
        num_decodes: decode sequences, whose tokens are the first ``num_decodes`` of the step
            when ``decode_token_idx`` is None, else at those indices.
        decode_block_tables / decode_seq_lens: ``[num_decodes, max_blocks]`` / ``[num_decodes]``.
        prefills: the prefill sequences.
        decode_mask: ``[num_decodes, 1, 1, decode_max_seq_len]`` bool, the context positions
            each decode row must not attend to; built once per step for every layer.
        window_masks: the same for sliding-window layers, by window, built by the first layer
            of each window that needs one.
        decode_key_lens: ``[num_decodes]`` int64, the positions each decode row attends below
            where some row sees past itself (its image's later tokens, see the module
            docstring; ``decode_max_seq_len`` covers them), else ``None``.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_max_seq_len: int
    prefills: list[PrefillSpan]
    decode_mask: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    decode_key_lens: torch.Tensor | None = None

    def decode_mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """The decode rows' mask for layers with ``sliding_window`` (None: full attention)."""
        if sliding_window is None or self.decode_mask is None:
            return self.decode_mask
        if sliding_window not in self.window_masks:
            self.window_masks[sliding_window] = decode_mask(
                self.decode_seq_lens, self.decode_max_seq_len, sliding_window, self.decode_key_lens
            )
        return self.window_masks[sliding_window]

    def decode(
        self,
        query,
        k_cache,
        v_cache,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention of the decode rows ``query [num_decodes, heads, head_dim]`` over their cached
        context (a fused backend overrides this), rows with key limits up to them (see the
        module docstring)."""
        return kernels.ops.paged_attention_decode(
            query,
            k_cache,
            v_cache,
            self.decode_block_tables,
            self.decode_seq_lens,
            self.decode_max_seq_len,
            scale,
            self.decode_mask_for(sliding_window),
            sliding_window,
            logits_soft_cap,
            self.decode_key_lens,
        )

    def forward(
        self,
        query,
        key,
        value,
        k_cache,
        v_cache,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Cache the step's K/V, then attend: ``query [T, heads, head_dim] -> [T, heads,
        head_dim]`` (see ``AttentionStep.forward`` for the options)."""
        ops = kernels.ops
        ops.reshape_and_cache(key, value, k_cache, v_cache, self.slot_mapping)
        options = (sliding_window, logits_soft_cap)
        if not self.prefills:
            return self.decode(query, k_cache, v_cache, scale, *options)
        out = torch.empty_like(query)
        if self.num_decodes:
            idx = self.decode_token_idx
            q = query[: self.num_decodes] if idx is None else query[idx]
            dec = self.decode(q, k_cache, v_cache, scale, *options)
            if idx is None:
                out[: self.num_decodes] = dec
            else:
                out[idx] = dec
        for p in self.prefills:
            out[p.start : p.end] = ops.paged_attention_prefill(
                query[p.start : p.end],
                key[p.start : p.end],
                value[p.start : p.end],
                k_cache,
                v_cache,
                p.block_table,
                p.context_len,
                scale,
                *options,
                *(() if p.key_limits is None else (p.key_limits,)),
            )
        return out


class TorchPagedAttentionBackend:
    """Builds a ``TorchPagedAttentionStep`` from each step's input batch (an
    :class:`~pyxllm.attention.abstract.AttentionBackend`). Its kernels read int8 caches too
    (``--kv-cache-dtype int8``).

    With ``batch_invariant`` (``--batch-invariant``, set by the executor), every token of the
    step attends through the decode kernel, one row each over its context up to itself: a row's
    sums then run over its own keys in one order whether its sequence is prefilled at once, in
    chunks over cached blocks, or decoded one token at a time (the prefill kernel reduces a
    chunk's queries together, in an order that depends on the chunk).
    """

    supports_int8_kv_cache = True
    supports_batch_invariance = True

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def build_decode(
        self, slot_mapping, block_tables, seq_lens, max_seq_len: int
    ) -> TorchPagedAttentionStep:
        """See ``AttentionBackend.build_decode``; the step's decode mask is built here, once
        for every layer (a device op over ``seq_lens``, which a graph captures)."""
        return TorchPagedAttentionStep(
            slot_mapping=slot_mapping,
            num_decodes=slot_mapping.shape[0],
            decode_token_idx=None,
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            decode_max_seq_len=max_seq_len,
            prefills=[],
            decode_mask=kernels.ops.decode_attention_mask(seq_lens, max_seq_len),
        )

    def build(self, batch) -> TorchPagedAttentionStep:
        """``batch``: an ``InputBatch`` (see ``pyxllm.executor.input_batch``). Its decode rows
        (:func:`decode_rows`: verified drafts included) attend through the decode kernel, the
        other sequences (prefill chunks) one call each."""
        tokens, seqs, lens = decode_rows(batch, every_token=self.batch_invariant)
        starts, query_lens = batch.query_start_list, batch.query_lens
        decoding = set(seqs)
        limited = set(batch.key_limit_seqs)
        prefills = [
            PrefillSpan(
                starts[i],
                starts[i] + n,
                batch.seq_lens_list[i],
                batch.block_tables[i],
                batch.key_limits[starts[i] : starts[i] + n] if i in limited else None,
            )
            for i, n in enumerate(query_lens)
            if i not in decoding
        ]
        # one row per sequence, in order: the batch's own tensors serve as they are
        plain = seqs == list(range(len(query_lens))) and tokens == seqs
        device = batch.seq_lens.device
        rows = torch.tensor(seqs, dtype=torch.long, device=device)
        decode_seq_lens = (
            batch.seq_lens if plain else torch.tensor(lens, dtype=torch.long, device=device)
        )
        max_seq_len = max(lens, default=0)
        key_lens = None
        # prefill tokens as decode rows (--batch-invariant)
        if limited and limited.intersection(seqs):
            key_lens = batch.key_limits[torch.tensor(tokens, device=device)] + 1
            max_seq_len = max(max_seq_len, int(key_lens.max()))
        return TorchPagedAttentionStep(
            slot_mapping=batch.slot_mapping,
            num_decodes=len(tokens),
            decode_token_idx=None
            if tokens == list(range(len(tokens)))
            else torch.tensor(tokens, dtype=torch.long, device=device),
            decode_block_tables=batch.block_tables if plain else batch.block_tables[rows],
            decode_seq_lens=decode_seq_lens,
            decode_max_seq_len=max_seq_len,
            prefills=prefills,
            decode_mask=decode_mask(decode_seq_lens, max_seq_len, None, key_lens)
            if tokens
            else None,
            decode_key_lens=key_lens,
        )


def decode_rows(batch, every_token: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The step's decode rows as ``(token indices, their sequences, context lengths)``: every
    token of a sequence that decodes (one token, or its last token and the drafts it verifies),
    or with ``every_token`` of every sequence (prefill chunks too), each attending to its
    context up to itself (a verified draft sees the drafts before it, whose K/V the step caches
    first). Computed by the decode kernel, a verifying sequence gets the attention decoding
    without speculation gives its tokens one at a time (the graph runner replays such steps as
    decode rows too).
    """
    tokens, seqs, lens = [], [], []
    for i, (start, n, drafts) in enumerate(
        zip(batch.query_start_list, batch.query_lens, batch.num_draft_tokens)
    ):
        if every_token or n == 1 + drafts:
            tokens += range(start, start + n)
            seqs += [i] * n
            lens += range(batch.seq_lens_list[i] - n + 1, batch.seq_lens_list[i] + 1)
    return tokens, seqs, lens


def decode_mask(
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sliding_window: int | None,
    key_lens: torch.Tensor | None,
) -> torch.Tensor:
    """The decode rows' mask (``kernels.ops.decode_attention_mask``); rows with key limits
    (``key_lens``, see the module docstring) through the native one, which takes them."""
    if key_lens is None:
        return kernels.ops.decode_attention_mask(seq_lens, max_seq_len, sliding_window)
    return native.decode_attention_mask(seq_lens, max_seq_len, sliding_window, key_lens)
