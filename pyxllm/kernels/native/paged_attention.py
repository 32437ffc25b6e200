"""Pure-PyTorch attention over a paged KV cache.

Cache layout (as in vLLM and DESIGN.md): per layer, ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its flat *slot* is
``block * block_size + offset``. Grouped-query attention (num_heads a multiple of num_kv_heads)
is handled by repeating each KV head for its query heads.

An int8 cache (``--kv-cache-dtype int8``) holds each token's row of a head as ``head_dim`` int8
values and then its float32 scale's 4 bytes: ``[num_blocks, block_size, num_kv_heads,
head_dim + 4]``, the row ``x`` stored as ``q = rint(x * (127 / max |x|))`` with scale
``max |x| / 127`` (a row of zeros: scale 0), read back as ``q * scale``
(:func:`quantize_kv`, :func:`dequantize_kv`). Keeping the scale beside its row keeps one
tensor per K and per V, so every path that moves cache blocks moves the scales with them.

Two per-layer options, as transformers' attention functions take them:

- ``sliding_window`` ``W``: the token at position ``q`` attends only to positions ``k`` with
  ``q - W < k <= q`` (its last ``W`` tokens, itself included; transformers'
  ``sliding_window_overlay``, Mistral's and Gemma's local layers).
- ``logits_soft_cap`` ``c``: scores ``s`` (already scaled) become ``c * tanh(s / c)`` before
  masking and softmax (Gemma 2, arXiv:2408.00118 section 2).

And one per-token option of a prefill: ``key_limits``, the last position each query token
attends to, its own (causal) or a later one: a token of an image that a model attends
bidirectionally (Gemma 3's, transformers' ``create_masks_for_vision_model``) sees its whole
image, up to the image's last token. The window's lower bound still counts from the token's
own position (transformers' ``AND(sliding_window, OR(causal, image block))``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# bytes of the float32 scale after each head row of an int8 cache
INT8_KV_SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` (float) as int8 cache rows ``[..., head_dim + 4]``: the int8 values,
    then the row's float32 scale as 4 bytes (see the module docstring)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: a true division (a Python number over a tensor is a reciprocal times it,
    # 1 ulp off at times, and the fused kernel writes the same bytes as this)
    full_scale = torch.full_like(amax, 127.0)
    q = torch.round(xf * torch.where(amax > 0, full_scale / amax, torch.zeros_like(amax)))
    scale = (amax / full_scale).contiguous().view(torch.int8)  # [..., 4]: the float32's bytes
    return torch.cat((q.to(torch.int8), scale), dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype``: int8 rows ``[..., head_dim + 4]`` as ``q * scale`` (computed in
    float32) ``[..., head_dim]``; float rows converted."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_KV_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's keys and values into the cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (int8: ``head_dim +
            4``, quantized rows), written in place.
        slot_mapping: ``[num_tokens]`` int64 flat slots; a negative slot (padding) writes nothing.
    """
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache in ((key, k_cache), (value, v_cache)):
        rows = quantize_kv(x) if cache.dtype == torch.int8 else x.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., kv_heads, L, D] -> [..., kv_heads * group, L, D]``: each KV head serves ``group``
    query heads.

    Expanding the KV heads ourselves keeps SDPA on its fast CPU path (its ``enable_gqa`` path with
    a mask measured ~10-50x slower here).
    """
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence: ``[length, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:length]


def decode_attention_mask(
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sliding_window: int | None = None,
    key_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[batch, 1, 1, max_seq_len]`` bool, true where a context position is past the sequence's
    end, or (with ``sliding_window``) ``sliding_window`` or more positions before its last token
    (to be masked); build it once per step and window, and pass it to every layer's decode.

    ``key_lens`` (``int64 [batch]``, each at least its ``seq_lens``, at most ``max_seq_len``):
    the positions each row attends below instead of ``seq_lens`` (a row of an image attended
    bidirectionally, which sees its image's later tokens; see the module docstring), the window
    still counted back from ``seq_lens``."""
    positions = torch.arange(max_seq_len, device=seq_lens.device).unsqueeze(0)
    lens = seq_lens.unsqueeze(1)
    mask = positions >= (lens if key_lens is None else key_lens.unsqueeze(1))
    if sliding_window is not None:
        mask |= positions < lens - sliding_window
    return mask.view(-1, 1, 1, max_seq_len)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``, or ``scores`` unchanged when ``cap`` is None (Gemma 2's
    attention and final-logit soft-capping)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _gather_heads_first(
    cache: torch.Tensor, block_ids: torch.Tensor, batch: int, length: int
) -> torch.Tensor:
    """The cached K or V of ``batch`` sequences as ``[batch, kv_heads, length, head_dim]``
    (contiguous).

    ``index_select`` over the flat block ids, then one transposing copy: ~5x and ~3x faster here
    than advanced indexing and than a matmul on the strided view.
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    blocks = cache.index_select(0, block_ids).view(batch, -1, num_kv_heads, head_dim)
    return blocks[:, :length].transpose(1, 2).contiguous()


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    key_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (the last
    ``sliding_window`` tokens of it when set), or up to its key limit (``key_lens``).

    Grouped-query attention without repeating KV heads: the ``group`` query heads of a KV head
    are one matmul's rows (``q [B, kv, group, D] @ k [B, kv, D, L]``). Softmax in float32. On a
    CPU this is 3-5x faster than ``scaled_dot_product_attention`` with a mask for one query
    token (measured with 1 thread: batch 64, 200 tokens, bf16: 6.3 ms -> 1.4 ms per layer).

    Args:
        query: ``[batch, num_heads, head_dim]`` (the new tokens; their K/V are already cached).
        block_tables: ``[batch, max_blocks]`` int64; seq_lens: ``[batch]`` int64 context lengths
            (tokens, including the new one); max_seq_len: the context span attended, at least
            ``max(seq_lens)``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        attn_mask: ``decode_attention_mask(seq_lens, max_seq_len, sliding_window, key_lens)``
            built once per step, or None to build it here.
        sliding_window, logits_soft_cap: see the module docstring (None: off).
        key_lens: ``int64 [batch]``, the positions each row attends below, each at least its
            ``seq_lens`` and at most ``max_seq_len`` (see :func:`decode_attention_mask`; read
            only to build the mask here), or None: ``seq_lens``.
    Returns:
        ``[batch, num_heads, head_dim]``.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_ids = block_tables[:, : (max_seq_len + block_size - 1) // block_size].reshape(-1)
    keys = dequantize_kv(_gather_heads_first(k_cache, block_ids, batch, max_seq_len), query.dtype)
    values = dequantize_kv(_gather_heads_first(v_cache, block_ids, batch, max_seq_len), query.dtype)
    q = (query * scale).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = soft_cap(torch.matmul(q, keys.transpose(-1, -2)), logits_soft_cap)  # [B, kv, group, L]
    if attn_mask is None:
        attn_mask = decode_attention_mask(seq_lens, max_seq_len, sliding_window, key_lens)
    scores = scores.masked_fill(attn_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def paged_attention_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens (a prompt or a chunk of it).

    The new tokens are the last ``query_len`` of the sequence's ``context_len`` tokens; token
    ``i`` of the chunk attends to every context token at position ``<= context_len - query_len +
    i``.
    When nothing was cached before (``context_len == query_len``) the step's own ``key``/``value``
    are used (with an int8 cache, as the cache holds them: quantized and back); otherwise the
    context is read from the cache (where this step's K/V already are).

    Args:
        query: ``[query_len, num_heads, head_dim]``; key, value: ``[query_len, num_kv_heads,
            head_dim]``.
        block_table: ``[max_blocks]`` int64 block ids of this sequence.
        context_len: tokens in the sequence after this chunk.
        sliding_window, logits_soft_cap: see the module docstring (None: off). A window reads
            only the cached blocks it reaches.
        key_limits: ``int64 [query_len]`` on the query's device, the last context position each
            token attends to: its own, or a later one of the chunk (an image attended
            bidirectionally, see the module docstring); every limit below ``context_len``, which
            the caller ensures (the chunk holds each such image to its end). ``None``: causal.
    Returns:
        ``[query_len, num_heads, head_dim]``.
    """
    if k_cache.dtype == torch.int8:
        # attend to what the cache holds, as decodes and later chunks will: the same values
        # whether a prompt is prefilled whole, in chunks or after a prefix-cache hit
        key, value = (dequantize_kv(quantize_kv(x), x.dtype) for x in (key, value))
    # SDPA takes its flash kernel on the CPU only for 4-D inputs (3-D ones fall back to the
    # math path: 1.6-1.8x slower here), hence the batch dimension of one.
    query_len, group = query.shape[0], query.shape[1] // key.shape[1]
    q = query.transpose(0, 1).unsqueeze(0)
    first_query = context_len - query_len
    # the first context position any query token can see
    start = 0 if sliding_window is None else max(0, first_query + 1 - sliding_window)
    plain = (
        logits_soft_cap is None
        and key_limits is None
        and (sliding_window is None or sliding_window >= context_len)
    )
    if context_len == query_len and plain:
        k, v = (_repeat_kv(x.transpose(0, 1), group).unsqueeze(0) for x in (key, value))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(
            0, 1
        )
    if context_len == query_len:
        k, v = key[start:], value[start:]
    else:
        block_size = k_cache.shape[1]
        first_block = start // block_size  # blocks wholly before the window are not read
        table, offset = block_table[first_block:], first_block * block_size
        k, v = (
            dequantize_kv(
                _gather_context(c, table, context_len - offset)[start - offset :], key.dtype
            )
            for c in (k_cache, v_cache)
        )
    k, v = (_repeat_kv(x.transpose(0, 1), group).to(query.dtype).unsqueeze(0) for x in (k, v))
    kv_pos = torch.arange(start, context_len, device=query.device)
    q_pos = torch.arange(first_query, context_len, device=query.device).unsqueeze(1)
    mask = kv_pos.unsqueeze(0) <= (q_pos if key_limits is None else key_limits.unsqueeze(1))
    if sliding_window is not None:
        mask &= kv_pos.unsqueeze(0) > q_pos - sliding_window
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = soft_cap(torch.matmul(q * scale, k.transpose(-1, -2)), logits_soft_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    return out[0].transpose(0, 1)
