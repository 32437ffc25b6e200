"""Sliding-window attention and soft-capping in the paged kernels, against dense attention.

The reference is attention over the whole context in float64 with the mask transformers builds
(``kv > q - window`` and ``kv <= q``) and Gemma 2's ``cap * tanh(s / cap)`` on the scaled scores;
the paged kernels read the same keys and values from a cache with a shuffled block table.
"""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.kernels import native
from tests.model_fixtures import WINDOW, build_checkpoint
from tests.models.test_models_parity import hf_generate

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 32
SCALE = HEAD_DIM**-0.5


def dense_reference(query, keys, values, q_positions, window, cap, image=None):
    """``query [Q, heads, D]`` at ``q_positions [Q]`` over ``keys``/``values [L, kv_heads, D]``
    (positions 0..L-1), float64; ``image`` ``(start, end)``: its tokens also see each other
    (transformers' ``create_masks_for_vision_model``: ``AND(window, OR(causal, block))``)."""
    group = query.shape[1] // keys.shape[1]
    q = query.double().transpose(0, 1)
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(-1, -2) * SCALE
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    kv = torch.arange(keys.shape[0])
    allowed = kv.unsqueeze(0) <= q_positions.unsqueeze(1)
    if image is not None:
        inside = lambda x: (x >= image[0]) & (x < image[1])  # noqa: E731
        allowed |= inside(kv).unsqueeze(0) & inside(q_positions).unsqueeze(1)
    if window is not None:
        allowed &= kv.unsqueeze(0) > q_positions.unsqueeze(1) - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)


def paged(context_len: int, seed: int):
    """Keys/values of one sequence of ``context_len`` tokens, and a cache holding them."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(context_len, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    num_blocks = -(-context_len // BLOCK_SIZE)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks]
    slots = (
        table.repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE
        + torch.arange(BLOCK_SIZE).repeat(num_blocks)
    )[:context_len]
    caches = [torch.zeros(num_blocks + 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(2)]
    native.reshape_and_cache(keys, values, *caches, slots)
    return keys, values, caches, table, g


@pytest.mark.parametrize("window", [None, 1, 4, 16, 17, 39, 64])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("query_len", [40, 7, 1])  # a whole prompt, a later chunk, one token
def test_prefill_matches_dense_attention(window, cap, query_len):
    context_len = 40
    keys, values, caches, table, g = paged(context_len, seed=query_len)
    query = torch.randn(query_len, HEADS, HEAD_DIM, generator=g) * 3
    got = native.paged_attention_prefill(
        query,
        keys[-query_len:],
        values[-query_len:],
        *caches,
        table,
        context_len,
        SCALE,
        sliding_window=window,
        logits_soft_cap=cap,
    )
    positions = torch.arange(context_len - query_len, context_len)
    want = dense_reference(query, keys, values, positions, window, cap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


IMAGE = (20, 36)  # an image's tokens in a 40-token context: they attend to each other


def image_key_limits(positions: torch.Tensor) -> torch.Tensor:
    """The last position each of ``positions`` attends to: its own, or :data:`IMAGE`'s last."""
    inside = (positions >= IMAGE[0]) & (positions < IMAGE[1])
    return torch.where(inside, IMAGE[1] - 1, positions)


@pytest.mark.parametrize("window", [None, 4, 16])
@pytest.mark.parametrize("query_len", [40, 24, 16])  # whole, from before the image, a hit inside
def test_prefill_key_limits_let_an_image_see_itself(window, query_len):
    context_len = 40
    keys, values, caches, table, g = paged(context_len, seed=query_len)
    query = torch.randn(query_len, HEADS, HEAD_DIM, generator=g) * 3
    positions = torch.arange(context_len - query_len, context_len)
    args = (query, keys[-query_len:], values[-query_len:], *caches, table, context_len, SCALE)
    got = native.paged_attention_prefill(
        *args, sliding_window=window, key_limits=image_key_limits(positions)
    )
    want = dense_reference(query, keys, values, positions, window, None, IMAGE)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    causal = native.paged_attention_prefill(*args, sliding_window=window)
    assert not torch.allclose(causal.double(), want, atol=1e-3)  # the limits move the image


@pytest.mark.parametrize("window", [None, 4])
def test_decode_rows_with_key_lens_see_their_image(window):
    # every token of one sequence as a decode row (--batch-invariant), the image's tokens
    # attending up to its last one: the mask built from key_lens, the window from seq_lens
    context_len = 40
    keys, values, caches, table, g = paged(context_len, seed=5)
    query = torch.randn(context_len, HEADS, HEAD_DIM, generator=g) * 3
    positions = torch.arange(context_len)
    seq_lens, key_lens = positions + 1, image_key_limits(positions) + 1
    mask = native.decode_attention_mask(seq_lens, context_len, window, key_lens)
    tables = table.expand(context_len, -1)
    got = native.paged_attention_decode(
        query, *caches, tables, seq_lens, context_len, SCALE, mask, window
    )
    want = dense_reference(query, keys, values, positions, window, None, IMAGE)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 33])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_decode_matches_dense_attention(window, cap):
    lens = [1, 17, 40, 33]
    rows = [paged(n, seed=i) for i, n in enumerate(lens)]
    max_blocks = max(len(r[3]) for r in rows)
    # one cache for the batch: each sequence's blocks shifted past the previous sequences'
    offsets = torch.tensor([0, *[r[2][0].shape[0] for r in rows]]).cumsum(0)
    k_cache = torch.cat([r[2][0] for r in rows])
    v_cache = torch.cat([r[2][1] for r in rows])
    tables = torch.stack(
        [torch.nn.functional.pad(r[3] + offsets[i], (0, max_blocks - len(r[3]))) for i, r in
         enumerate(rows)]
    )  # fmt: skip
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)) * 3
    seq_lens = torch.tensor(lens)
    got = native.paged_attention_decode(
        query, k_cache, v_cache, tables, seq_lens, max(lens), SCALE,
        sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    for i, (keys, values, *_rest) in enumerate(rows):
        want = dense_reference(
            query[i : i + 1], keys, values, torch.tensor([lens[i] - 1]), window, cap
        )
        torch.testing.assert_close(got[i : i + 1].double(), want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, hf_gguf_tokenizer):
    """A tiny Mistral (window :data:`WINDOW`) checkpoint and its transformers model."""
    return build_checkpoint("mistral", tmp_path_factory.mktemp("mistral"), hf_gguf_tokenizer)


LONG = "Once upon a time there was a little fox who lived at the edge of a very large forest"


@pytest.mark.usefixtures("one_thread")
def test_windowed_model_matches_transformers_through_chunks_and_prefix_hits(mistral):
    """Prompts longer than the window, prefilled in chunks of 8 tokens, then again from the
    prefix cache: every run equals transformers, and the window is really applied (transformers
    without it continues differently)."""
    directory, hf = mistral
    llm = LLM(model=str(directory), max_model_len=96, kv_cache_memory=0.05, max_tokens_per_batch=8)
    prompts = [LONG, LONG + " and", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts, greedy)
    ids = [o.prompt_token_ids for o in first]
    assert min(len(i) for i in ids) > 2 * WINDOW
    want = hf_generate(hf, ids, 12)
    assert [list(o.outputs[0].token_ids) for o in first] == want
    kv = llm.llm_engine.kv_cache_manager
    hits = kv.num_hits
    again = llm.generate(prompts, greedy)
    assert kv.num_hits > hits  # the second pass started from cached blocks
    assert [list(o.outputs[0].token_ids) for o in again] == want
    hf.config.sliding_window = None
    try:
        assert hf_generate(hf, ids, 12) != want
    finally:
        hf.config.sliding_window = WINDOW
