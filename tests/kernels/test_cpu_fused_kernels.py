"""The fused C++ CPU kernels (``pyxllm.kernels.cpu.fused``) against the pure-PyTorch reference.

Tolerances: in float32 the kernels differ from the reference only in summation order and the
last bits of exp (a few ulp); in bfloat16, where the reference rounds intermediates to bf16,
the kernels round at the same places, so elementwise ops agree exactly and attention (whose
scores and probabilities the kernel keeps in float32) within bf16 rounding.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pyxllm.kernels import native
from pyxllm.kernels.cpu import fused
from pyxllm.kernels.cpu.features import cpu_flags
from pyxllm.kernels.native.paged_attention import quantize_kv
from pyxllm.kernels.native.quantized import SuperBlockScales
from tests.paths import REPO_ROOT

# (a failed build stops the suite in tests/conftest.py: only PYXLLM_CPU_KERNELS=native skips)
pytestmark = pytest.mark.skipif(
    fused.load() is None, reason="PYXLLM_CPU_KERNELS=native: the fused CPU kernels are off"
)

DTYPES = [torch.float32, torch.bfloat16]


def close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    fp32_tol: float = 2e-6,
    bf16_tol: float = 0.0,
) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    tol = fp32_tol if dtype == torch.float32 else bf16_tol
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_norms_and_activation_match_native(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 576, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    close(fused.rms_norm(x, weight, 1e-5), native.rms_norm(x, weight, 1e-5), dtype)
    for got, want in zip(
        fused.fused_add_rms_norm(x, residual, weight, 1e-5),
        native.fused_add_rms_norm(x, residual, weight, 1e-5),
    ):
        close(got, want, dtype)
    gate_up = 4 * torch.randn(tokens, 2 * 1536, generator=g).to(dtype)
    close(fused.silu_and_mul(gate_up), native.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_qkv_views_matches_native_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 960, generator=g).to(dtype)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)  # views with row stride 960, as in the model
    q, k = q.view(5, 9, 64), k.view(5, 3, 64)
    cos, sin = native.rotary_cos_sin(
        torch.tensor([0, 3, 17, 500, 2047]), torch.randn(2048, 64, generator=g), dtype
    )
    for got, want in zip(
        fused.apply_rotary_emb(q, k, cos, sin), native.apply_rotary_emb(q, k, cos, sin)
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the two unrolled sizes, and the generic loop
@pytest.mark.parametrize("window", [None, 5, 16, 33])  # within a block, one block, across blocks
def test_cache_write_and_decode_attention_match_native(dtype, head_dim, window):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads = 24, 16, 3
    caches = [
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        for _ in range(2)
    ]
    ours, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    slots = torch.tensor([5, -1, 100, 383])  # -1: padding, written nowhere
    key, value = (torch.randn(4, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    fused.reshape_and_cache(key, value, *ours, slots)
    native.reshape_and_cache(key, value, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])

    block_tables = torch.randperm(num_blocks, generator=g)[:16].view(4, 4)
    seq_lens = torch.tensor([1, 17, 64, 40])
    query = torch.randn(4, 9, head_dim, generator=g).to(dtype)
    args = (query, *ours, block_tables, seq_lens, 64, head_dim**-0.5)
    got = fused.paged_attention_decode(*args, sliding_window=window)
    want = native.paged_attention_decode(*args, sliding_window=window)
    close(got, want, dtype, bf16_tol=2e-2)
    if window is not None:  # the window changes the rows longer than it
        full = native.paged_attention_decode(*args)
        longer = seq_lens > window
        assert not torch.allclose(got[longer].float(), full[longer].float(), atol=1e-3)
        close(got[~longer], full[~longer], dtype, bf16_tol=2e-2)


def _decode_inputs(dtype, head_dim: int, seed: int, cache_dtype=None):
    """``(query [5, 6, head_dim], k_cache, v_cache, block_tables [5, 4])`` over 24 blocks of 16
    tokens, 2 KV heads (3 query heads each); ``cache_dtype`` int8: quantized cache rows."""
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(24, 16, 2, head_dim, generator=g).to(dtype) for _ in range(2)]
    if cache_dtype == torch.int8:
        caches = [quantize_kv(c) for c in caches]
    tables = torch.randperm(24, generator=g)[:20].view(5, 4)
    return torch.randn(5, 6, head_dim, generator=g).to(dtype), *caches, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("window", [None, 5, 33])
def test_decode_attention_with_key_lens_matches_native(dtype, head_dim, window):
    """Rows with key limits (a Gemma 3 image's prompt tokens under ``--batch-invariant``) see
    positions up to their limit, the window counted back from their own length: the native
    kernel's mask; a row whose limit is its length gets the bits it gets without limits."""
    query, k_cache, v_cache, tables = _decode_inputs(dtype, head_dim, seed=3)
    seq_lens = torch.tensor([1, 17, 40, 30, 12])
    key_lens = torch.tensor([9, 17, 64, 45, 12])
    args = (query, k_cache, v_cache, tables, seq_lens, 64, head_dim**-0.5)
    got = fused.paged_attention_decode(*args, sliding_window=window, key_lens=key_lens)
    want = native.paged_attention_decode(*args, sliding_window=window, key_lens=key_lens)
    close(got, want, dtype, bf16_tol=2e-2)
    causal = fused.paged_attention_decode(*args, sliding_window=window)
    same = key_lens == seq_lens
    assert torch.equal(got[same], causal[same])
    # the limits move the other rows (else this test proves nothing)
    assert not torch.allclose(got[~same].float(), causal[~same].float(), atol=1e-3)


@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    # the unrolled and the generic loops, and an int8 cache's (float32 queries)
    [(torch.float32, 64), (torch.float32, 40), (torch.bfloat16, 64), (torch.bfloat16, 40),
     (torch.int8, 64)],
    ids=str,
)  # fmt: skip
def test_decode_attention_gives_a_row_the_same_bits_beside_any_rows(dtype, head_dim):
    """A row's output, key limit or not, does not depend on the rows beside it: longer
    contexts, longer limits, other windows' starts, on one thread and on two (where a short
    batch splits each row's KV heads between tasks)."""
    act = torch.float32 if dtype == torch.int8 else dtype
    query, k_cache, v_cache, tables = _decode_inputs(act, head_dim, seed=4, cache_dtype=dtype)
    # our rows: an image token seeing 5 positions past itself, and a text token; beside them
    # a longer image row, a long text row and an empty (padding) row
    seq_lens = torch.tensor([10, 21, 50, 63, 0])
    key_lens = torch.tensor([15, 21, 64, 63, 0])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for window in (None, 5):
                batch = fused.paged_attention_decode(
                    query, k_cache, v_cache, tables, seq_lens, 64, 0.125, None, window,
                    key_lens=key_lens,
                )  # fmt: skip
                for row in (0, 1):
                    alone = fused.paged_attention_decode(
                        query[row : row + 1], k_cache, v_cache, tables[row : row + 1],
                        seq_lens[row : row + 1], 64, 0.125, None, window,
                        key_lens=key_lens[row : row + 1],
                    )  # fmt: skip
                    assert torch.equal(batch[row], alone[0]), (n, window, row)
                assert torch.equal(batch[4], torch.zeros_like(batch[4]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [4, 7, 8])  # query heads a KV head: one pass or several
def test_decode_attention_gives_a_query_head_its_bits_in_any_group(dtype, head_dim, group):
    """The query heads sharing a KV head are attended together (bfloat16 reads each value row
    once for up to 6 heads at head_dim 64, 3 at 128): a head's output is the native kernel's
    within tolerance and, bit for bit, what it gets as the only head of its KV head."""
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = (torch.randn(24, 16, 2, head_dim, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(24, generator=g)[:20].view(2, 10)
    seq_lens = torch.tensor([150, 37])  # an even and an odd count of value rows
    query = torch.randn(2, 2 * group, head_dim, generator=g).to(dtype)
    args = (k_cache, v_cache, tables, seq_lens, 160, head_dim**-0.5)
    grouped = fused.paged_attention_decode(query, *args)
    close(grouped, native.paged_attention_decode(query, *args), dtype, bf16_tol=2e-2)
    for h in (0, group - 1, group, 2 * group - 1):  # first and last of each KV head's group
        kv = h // group
        alone = fused.paged_attention_decode(
            query[:, h : h + 1],
            k_cache[:, :, kv : kv + 1].contiguous(),
            v_cache[:, :, kv : kv + 1].contiguous(),
            *args[2:],
        )
        assert torch.equal(grouped[:, h], alone[:, 0]), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_over_long_contexts_matches_native_with_the_same_bits_anywhere(
    dtype, head_dim
):
    """Rows of more than 256 keys (attended in chunks of 256 and combined, in bfloat16 on
    AVX512-BF16) match the native kernel, windowed or not, and a row's bits are the same alone
    or beside others, on one thread or two."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(80, 16, 3, head_dim, generator=g).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(80, generator=g)[:70] for _ in range(4)])
    seq_lens = torch.tensor([1000, 257, 256, 600])  # chunks of 256: 4, 2 (one of 1 key), 1, 3
    key_lens = torch.tensor([1000, 300, 256, 600])  # row 1 sees 43 keys past itself
    query = torch.randn(4, 9, head_dim, generator=g).to(dtype)
    args = (k_cache, v_cache, tables, seq_lens, 1120, head_dim**-0.5)
    threads = torch.get_num_threads()
    try:
        for window in (None, 300):
            results = []
            for n in (1, 2):
                torch.set_num_threads(n)
                batch = fused.paged_attention_decode(
                    query, *args, sliding_window=window, key_lens=key_lens
                )
                want = native.paged_attention_decode(
                    query, *args, sliding_window=window, key_lens=key_lens
                )
                close(batch, want, dtype, fp32_tol=2e-5, bf16_tol=2e-2)
                for row in range(4):
                    alone = fused.paged_attention_decode(
                        query[row : row + 1], k_cache, v_cache, tables[row : row + 1],
                        seq_lens[row : row + 1], *args[4:], sliding_window=window,
                        key_lens=key_lens[row : row + 1],
                    )  # fmt: skip
                    assert torch.equal(batch[row], alone[0]), (n, window, row)
                results.append(batch)
            assert torch.equal(results[0], results[1]), window
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_refuses_key_lens_outside_the_context():
    query, k_cache, v_cache, tables = _decode_inputs(torch.float32, 64, seed=5)
    seq_lens = torch.tensor([10, 21, 50, 63, 1])
    args = (query, k_cache, v_cache, tables, seq_lens, 64, 0.125)
    ok = seq_lens.clone()
    for key_lens, match in (
        (ok.clone().index_fill_(0, torch.tensor([2]), 49), r"key_lens\[2\] = 49 must lie between"),
        (ok.clone().index_fill_(0, torch.tensor([3]), 65), r"block table's 64 tokens"),
        (ok[:4], r"key_lens must be \[batch\]"),
    ):
        with pytest.raises(RuntimeError, match=match):
            fused.paged_attention_decode(*args, key_lens=key_lens)


def test_decode_attention_refuses_seq_lens_past_the_block_table():
    """A length past the row's block table (or a seq_lens of another size) is an error, not a
    read past the row's blocks (it crashed the process with a segmentation fault)."""
    query, k_cache, v_cache, tables = _decode_inputs(torch.float32, 64, seed=5)
    for seq_lens, match in (
        (
            torch.tensor([10, 21, 50, 1000, 1]),
            r"seq_lens\[3\] = 1000 lies outside the block table's 64",
        ),
        (torch.tensor([10, 21, 50, -1, 1]), r"seq_lens\[3\] = -1"),
        (torch.tensor([10, 21, 50]), r"seq_lens must be \[batch\]"),
    ):
        with pytest.raises(RuntimeError, match=match):
            fused.paged_attention_decode(query, k_cache, v_cache, tables, seq_lens, 64, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_linear_matches_native_exactly(dtype):
    """Same int8 activations, exact int32 sums and the same float32 rescaling: bit-equal, also
    for a row of zeros, a bias, odd sizes, 1 to 8 rows, a Hadamard transform first, a 3-D
    strided input and no rows at all."""
    from pyxllm.layers.quantization import quantize_int8_per_channel

    g = torch.Generator().manual_seed(2)
    shapes = [(1, 576, 960), (64, 1536, 576), (3, 40, 24), (0, 64, 32)]
    # every row count the small-batch kernel specializes, with column and input tails
    shapes += [(rows, 200, 100) for rows in range(1, 9)]
    for rows, k, n in shapes:
        x = torch.randn(rows, k, generator=g).to(dtype)
        if rows:
            x[0] = 0
        q, scales = quantize_int8_per_channel(torch.randn(n, k, generator=g))
        for bias in (None, torch.randn(n, generator=g).to(dtype)):
            got, want = (
                fused.w8a8_linear(x, q, scales, bias),
                native.w8a8_linear(x, q, scales, bias),
            )
            assert got.dtype == dtype and torch.equal(got, want)
    x = torch.randn(5, 1536, generator=g).to(dtype)
    q, scales = quantize_int8_per_channel(torch.randn(64, 1536, generator=g))
    for block in (512, 2):  # the down projection's online Hadamard transform
        assert torch.equal(
            fused.w8a8_linear(x, q, scales, None, block),
            native.w8a8_linear(x, q, scales, None, block),
        )
    with pytest.raises(RuntimeError, match="power of two"):
        fused.w8a8_linear(x, q, scales, None, 384)
    x = torch.randn(2, 3, 2 * 576, generator=g).to(dtype)[..., ::2]
    q, scales = quantize_int8_per_channel(torch.randn(96, 576, generator=g))
    assert torch.equal(fused.w8a8_linear(x, q, scales), native.w8a8_linear(x, q, scales))
    assert fused.w8a8_linear(x, q, scales).shape == (2, 3, 96)
    with pytest.raises(RuntimeError, match="weight_scales must be float32"):
        fused.w8a8_linear(x, q, scales.to(dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="input features"):
        fused.w8a8_linear(x[..., :64], q, scales)


class Grouped:
    """One of the grouped weight formats of ``csrc/group_linear.cpp``: ``int4`` (``W = (q - 8)
    scale + zero``, q in 0..15, groups of 32) or ``int8`` (``W = q scale + zero``, q in
    -128..127) in groups of ``group`` (32 or 16), with its quantizer, pack, kernel and
    reference; ``int6``: int8 weights whose q lie in -32..31, which the int8 pack holds in 6
    bits (``q + 32``, ``low = zero - 32 scale``)."""

    def __init__(self, name: str, group: int = 32) -> None:
        self.name, self.group, self.offset = name, group, 8 if name == "int4" else 0
        self.pack_offset = {"int4": 8, "int8": 0, "int6": 32}[name]  # low = zero - it * scale
        self.levels = 31 if name == "int6" else 127  # q in -levels-1..levels
        name = "int8" if name == "int6" else name
        self.pack = getattr(
            fused, f"pack_{name}_weight" if name == "int4" else "pack_int8_group_weight"
        )
        self.kernel = getattr(fused, "int4_linear" if name == "int4" else "int8_group_linear")
        self.reference = getattr(native, "int4_linear" if name == "int4" else "int8_group_linear")
        self.native_pack = getattr(
            native, "pack_int4_weight" if name == "int4" else "pack_int8_group_weight"
        )

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [N, K], scales_and_zeros [K/32, N, 2] float32)`` of ``w``: int4 by the Q4_1 rule;
        int8 around each group's mean (a nonzero zero, as GGUF's 5-bit formats have), the
        largest deviation at +-127."""
        from pyxllm.layers.quantization import quantize_int4_groups

        if self.name == "int4":
            return quantize_int4_groups(w)
        n, k = w.shape
        g = w.view(n, k // self.group, self.group)
        zero = g.mean(-1)
        scale = (g - zero.unsqueeze(-1)).abs().amax(-1) / self.levels
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((g - zero.unsqueeze(-1)) * inv.unsqueeze(-1))
        q = q.clamp(-self.levels - 1, self.levels)
        return q.to(torch.int8).view(n, k), torch.stack((scale, zero), -1).transpose(0, 1)

    def weights(self, q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` float64 weights the format stands for."""
        n, k = q.shape
        scale, zero = (scales_and_zeros[..., i].double().t().unsqueeze(-1) for i in (0, 1))
        w = (q.double().view(n, k // self.group, self.group) - self.offset) * scale + zero
        return w.view(n, k)

    def stored(self, pairs: torch.Tensor) -> torch.Tensor:
        """The ``[K/G, N, 2]`` float64 (scale, zero) that the packed ``(scale, low)`` pairs (in
        the dtype the pack chose) stand for."""
        groups = pairs.shape[1]
        if pairs.dim() == 3:  # scales alone: every zero 0
            scale = pairs.transpose(0, 1).reshape(groups, -1).double()
            return torch.stack((scale, torch.zeros_like(scale)), dim=-1)
        scale, low = pairs.transpose(0, 1).reshape(groups, -1, 2).double().unbind(-1)
        return torch.stack((scale, low + self.pack_offset * scale), dim=-1)

    def __repr__(self) -> str:
        return f"{self.name}/{self.group}"


GROUPED = [
    Grouped("int4"),
    Grouped("int8"),
    Grouped("int8", 16),
    Grouped("int6"),
    Grouped("int6", 16),
]


def grouped_reference(fmt: Grouped, x: torch.Tensor, q: torch.Tensor, scales_and_zeros):
    """``(y, terms, bound)``: the grouped kernels' arithmetic in float64 (csrc/group_linear.cpp),
    each row's groups of 32 as ``x / s ~= q1 + q2 / 254`` (both int8, ``s = max |x| / 127``,
    quantized in float32 as the kernel does), the integer dot products with the weights' q,
    then the group's scale and the sum of the quantized activations times what q = 0 stands
    for; ``terms``, the
    sum of those two products' magnitudes over the groups (float32 rounds each, and they cancel:
    int4's ``(q - 8) * scale + zero`` has a large zero); ``bound``, that of ``y``'s difference
    from float activations: ``|x - s (q1 + q2 / 254)| <= s / 508`` per activation, times the
    group's ``sum |W|``."""
    rows, k = x.shape
    n, groups = q.shape[0], k // 32
    xg = x.float().view(rows, groups, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    v = xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q1 = torch.round(v)
    q2 = torch.round((v - q1) * 254)
    step = (amax.double() / 127).expand(rows, groups, 32).reshape(rows, k)  # per activation
    # per weight group: the activations' two parts (times their step) and their float sum
    parts = ((q1.double() + q2.double() / 254).reshape(rows, k) * step).view(rows, -1, fmt.group)
    xsum = parts.sum(-1)  # of the quantized activations, as the kernel sums them
    # the kernel's q: int6's q + 32 (W = (q + 32) * scale + low)
    qg = (q.double() + fmt.pack_offset - fmt.offset).view(n, -1, fmt.group)
    scale, zero = (scales_and_zeros[..., i].double().t() for i in (0, 1))  # [N, groups]
    dots = torch.einsum("rgk,ngk->rng", parts, qg)
    low = zero - fmt.pack_offset * scale
    products = (dots * scale, low * xsum.unsqueeze(1))
    y = (products[0] + products[1]).sum(-1)
    terms = (products[0].abs() + products[1].abs()).sum(-1)
    weight = fmt.weights(q, scales_and_zeros).view(n, -1, fmt.group)
    err = (step / 508).view(rows, -1, fmt.group)[..., 0]  # one step per weight group
    bound = torch.einsum("rg,ng->rn", err, weight.abs().sum(-1))
    return y, terms, bound


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_is_the_w_a8_arithmetic_and_near_float_activations(fmt, dtype):
    """Against the same arithmetic in float64: within float32's rounding of it (bfloat16: and
    the output's rounding); that arithmetic against float activations times the same weights:
    within the activations' two-part rounding bound; with a bias, a 3-D strided input, a group
    of zeros and no rows."""
    g = torch.Generator().manual_seed(4)
    for rows, k, n in [(1, 576, 192), (8, 1536, 96), (21, 64, 32)]:
        q, scales_and_zeros = fmt.quantize(torch.randn(n, k, generator=g) * 0.05)
        scales_and_zeros = scales_and_zeros.to(dtype)
        packed, pairs = fmt.pack(q, scales_and_zeros)
        scales_and_zeros = fmt.stored(pairs)  # bfloat16: low rounded once to it
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
        x[0, :32] = 0  # a group of zeros: scale 0, no division by it
        want, terms, bound = grouped_reference(fmt, x, q, scales_and_zeros)
        # float32 rounds each group's two products, their sum and the running sum: at most
        # (k/32 + 2) roundings of eps/2 of the terms; int8's integer sums (up to 32 * 128 * 127
        # * 254 > 2**24) are rounded once more when converted; then the output is rounded to
        # its dtype
        per_group = (1 if fmt.name == "int4" else 2) * 32 // fmt.group
        rounding = (per_group * k // 32 + 2) * torch.finfo(torch.float32).eps * terms
        ulp = 0.0 if dtype == torch.float32 else 2.0**-8
        got = fmt.kernel(x, packed, pairs, fmt.group)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert bool(((got.double() - want).abs() <= rounding + ulp * want.abs()).all())
        exact = F.linear(x.double(), fmt.weights(q, scales_and_zeros))
        assert bool(((want - exact).abs() <= bound + 1e-12).all())
        bias = torch.randn(n, generator=g).to(dtype)
        with_bias = fmt.kernel(x, packed, pairs, fmt.group, bias).double()
        want = want + bias.double()
        add = torch.finfo(torch.float32).eps + 2 * ulp  # the bias added in float32, rounded
        assert bool(((with_bias - want).abs() <= rounding + add * want.abs()).all())
    strided = torch.randn(2, 3, 2 * k, generator=g).to(dtype)[..., ::2]
    assert torch.equal(
        fmt.kernel(strided, packed, pairs, fmt.group),
        fmt.kernel(strided.contiguous(), packed, pairs, fmt.group),
    )
    assert fmt.kernel(strided, packed, pairs, fmt.group).shape == (2, 3, n)
    assert fmt.kernel(x[:0], packed, pairs, fmt.group).shape == (0, n)


def test_int8_group_linear_takes_the_extreme_weights():
    """q = -128 (|q| = 128 as an unsigned byte) and 127 against activations of +-127: the
    AVX2 pairs of products (at most 2 * 128 * 127) do not saturate."""
    q = torch.full((16, 64), -128, dtype=torch.int8)
    q[::2] = 127
    scales_and_zeros = torch.ones(2, 16, 2)
    scales_and_zeros[..., 1] = 0
    x = torch.ones(1, 64)
    x[0, 1::2] = -1
    x[0, :2] = 1
    got = fused.int8_group_linear(x, *fused.pack_int8_group_weight(q, scales_and_zeros), 32)
    want = F.linear(x.double(), q.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_of_many_rows_is_a_gemm_on_the_dequantized_weights(fmt, dtype):
    """Above 32 rows (a prefill) the kernel dequantizes the weights and runs a GEMM: the
    reference's result (dequantize, ``F.linear``) up to the rounding of the weights to the
    dtype and of the sums."""
    g = torch.Generator().manual_seed(6)
    q, scales_and_zeros = fmt.quantize(torch.randn(96, 576, generator=g) * 0.05)
    scales_and_zeros = scales_and_zeros.to(dtype)
    x, bias = torch.randn(40, 576, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    got = fmt.kernel(x, *fmt.pack(q, scales_and_zeros), fmt.group, bias)
    want = fmt.reference(x, *fmt.native_pack(q, scales_and_zeros), fmt.group, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
def test_grouped_linear_gives_a_row_the_same_bits_in_any_batch(fmt):
    """Up to 32 rows, every row is computed by the same instructions whatever the other rows
    are (so a sequence verifying speculative drafts gets the logits it gets one token at a
    time)."""
    g = torch.Generator().manual_seed(5)
    q, scales_and_zeros = fmt.quantize(torch.randn(64, 576, generator=g))
    for dtype in (torch.float32, torch.bfloat16):  # float32 shows every bit of the sums
        packed, pairs = fmt.pack(q, scales_and_zeros.to(dtype))
        x = torch.randn(32, 576, generator=g).to(dtype)
        alone = torch.cat([fmt.kernel(row[None], packed, pairs, fmt.group) for row in x])
        for rows in range(2, 33):
            assert torch.equal(fmt.kernel(x[:rows], packed, pairs, fmt.group), alone[:rows])
        assert torch.equal(fmt.kernel(x.flip(0), packed, pairs, fmt.group), alone.flip(0))


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
def test_batch_invariant_grouped_linear_gives_a_row_its_bits_at_any_row_count(fmt):
    """With ``batch_invariant`` the integer path runs at every row count (a prefill of 80 rows
    too), so a row's bits are those it gets alone; without it, above 32 rows the GEMM on the
    dequantized weights gives other bits."""
    g = torch.Generator().manual_seed(8)
    q, scales_and_zeros = fmt.quantize(torch.randn(64, 576, generator=g))
    packed, pairs = fmt.pack(q, scales_and_zeros)
    x, bias = torch.randn(80, 576, generator=g), torch.randn(64, generator=g)
    alone = torch.cat([fmt.kernel(row[None], packed, pairs, fmt.group, bias) for row in x])
    for rows in (33, 47, 80):
        got = fmt.kernel(x[:rows], packed, pairs, fmt.group, bias, True)
        assert torch.equal(got, alone[:rows])
    assert not torch.equal(fmt.kernel(x, packed, pairs, fmt.group, bias), alone)


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_read_the_packed_tiles_as_the_reference_reads_its_rows(fmt, dtype):
    """A tied token embedding looks its rows up in the LM head's packed tiles: every row, in
    any order and repeated, is the format's value (in float64 from the packed pairs) up to
    float32's rounding; with float32 pairs, those of the reference's unpacked reader (the same
    bits for int8, whose ``q * scale + zero`` is the packed formula too)."""
    g = torch.Generator().manual_seed(7)
    q, scales_and_zeros = fmt.quantize(torch.randn(48, 96, generator=g))
    scales_and_zeros = scales_and_zeros.to(dtype)
    ids = torch.tensor([47, 0, 16, 15, 31, 0, 33])
    name = "int4_rows" if fmt.name == "int4" else "int8_group_rows"
    packed, pairs = fmt.pack(q, scales_and_zeros)
    got = getattr(fused, name)(packed, pairs, ids, fmt.group)
    want = fmt.weights(q, fmt.stored(pairs))[ids]
    assert got.dtype == torch.float32 and got.shape == (len(ids), 96)
    # float32's rounding of q * scale + low, |low| up to (pack offset + 1) * scale (~0.1 here)
    atol = 1e-7 * max(1, fmt.pack_offset // 8)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=atol)
    if dtype == torch.float32:
        reference = getattr(native, name)(*fmt.native_pack(q, scales_and_zeros), ids, fmt.group)
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=atol)
        # int8's packed formula is the reference's, q * scale + zero; int4's and int6's add a
        # low computed when packing
        assert fmt.name != "int8" or torch.equal(got, reference)


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
def test_grouped_pairs_are_held_in_float16_where_that_is_exact(fmt):
    """Scales and lows that are float16 numbers (a GGUF Q4_0, Q4_1 or Q8_0 file's) are packed
    as float16, and the kernel gives the bits it gives with the same pairs in float32, one row
    or a GEMM's 40; a scale float16 cannot hold keeps the pairs in the given dtype."""
    g = torch.Generator().manual_seed(9)
    q, scales_and_zeros = fmt.quantize(torch.randn(64, 576, generator=g))
    scale = scales_and_zeros[..., 0].half().float()
    # low: -8 d, -d, 0
    zero = {"int4": torch.zeros_like(scale), "int8": scale.neg(), "int6": 32 * scale}[fmt.name]
    packed, pairs = fmt.pack(q, torch.stack((scale, zero), dim=-1))
    assert pairs.dtype == torch.float16
    x = torch.randn(40, 576, generator=g)
    for rows in (1, 40):
        got = fmt.kernel(x[:rows], packed, pairs, fmt.group)
        assert torch.equal(got, fmt.kernel(x[:rows], packed, pairs.float(), fmt.group))
    inexact = torch.stack((scale + scale * 2.0**-14, zero), dim=-1)
    assert fmt.pack(q, inexact)[1].dtype == torch.float32
    tiny = torch.stack((scale * 2.0**-20, zero), dim=-1).bfloat16()  # below float16's range
    assert fmt.pack(q, tiny)[1].dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", GROUPED, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_groups_keep_their_scales_alone_with_the_same_bits(fmt, dtype):
    """Where every zero is 0 (GGUF's Q4_0: ``(q - 8) d``; Q8_0 and Q6_K: ``q d``) the pack keeps
    the scales alone, ``[N/16, G, 16]`` (half the bytes of the pairs), and the kernel derives
    each low from its scale: the same bits as the same weights held as pairs, one row, 8 rows,
    a GEMM's 40 and 40 row-invariant rows, and the same rows read back; in float16 where the
    scales are float16 numbers, else in the given dtype."""
    g = torch.Generator().manual_seed(10)
    q, scales_and_zeros = fmt.quantize(torch.randn(64, 576, generator=g))
    for scale in (
        scales_and_zeros[..., 0].half().float(),  # a Q4_0 / Q8_0 file's
        scales_and_zeros[..., 0] * (1 + 2.0**-13),  # a K-quant's product of two levels
    ):
        symmetric = torch.stack((scale, torch.zeros_like(scale)), dim=-1).to(dtype)
        packed, scales = fmt.pack(q, symmetric)
        assert scales.shape == (64 // 16, 576 // fmt.group, 16)
        given = symmetric[..., 0].float()
        exact = torch.equal(given.half().float(), given)
        assert scales.dtype == (torch.float16 if exact else dtype)
        # the same numbers as (scale, low) pairs, as the pack holds them for nonzero zeros
        pairs = torch.stack((scales, -fmt.pack_offset * scales), dim=-1)
        x = torch.randn(40, 576, generator=g).to(dtype)
        for rows, invariant in ((1, False), (8, False), (40, False), (40, True)):
            got = fmt.kernel(x[:rows], packed, scales, fmt.group, None, invariant)
            want = fmt.kernel(x[:rows], packed, pairs, fmt.group, None, invariant)
            assert torch.equal(got, want), (rows, invariant)
        name = "int4_rows" if fmt.name == "int4" else "int8_group_rows"
        ids = torch.tensor([63, 0, 17, 17])
        assert torch.equal(
            getattr(fused, name)(packed, scales, ids, fmt.group),
            getattr(fused, name)(packed, pairs, ids, fmt.group),
        )


def _super_block_scales(
    fmt: Grouped, n: int, k: int, lows: bool, g: torch.Generator, shift: int = 0
) -> SuperBlockScales:
    """Random :class:`SuperBlockScales` of ``fmt``'s groups: float16 ``d`` per 256 inputs
    (``dlow`` negative, as a K-quant's ``-dmin``), 6-bit integers per group (signed where the
    format's q is)."""
    per_lane = 2 if lows else 1
    d = (torch.rand(k // 256, n, per_lane, generator=g) * 0.01 + 1e-4).half().float()
    d[..., 1:] = -d[..., 1:]
    low = 0 if fmt.name == "int4" else -32
    sub = torch.randint(low, low + 64, (k // fmt.group, n, per_lane), generator=g)
    return SuperBlockScales(d, sub.to(torch.int8), shift=shift)


# the formats, whether their lows are d * m (a Q4_K's) or derived from the scale (Q6_K's,
# Q3_K's, IQ4_XS's), and the shift of q: 6-bit weights with lows of their own (a Q5_K's, q in
# -16..15 with shift 16; a Q2_K's, q in 0..3) are packed as q + shift
SUPER_BLOCK_CASES = [
    (GROUPED[0], True, 0), (GROUPED[1], False, 0), (GROUPED[1], True, 0), (GROUPED[2], False, 0),
    (GROUPED[3], False, 0), (GROUPED[4], False, 0), (GROUPED[3], True, 16), (GROUPED[4], True, 0),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "lows", "shift"), SUPER_BLOCK_CASES, ids=repr)
def test_super_block_scales_give_the_bits_of_float32_pairs(fmt, lows, shift):
    """Scales factored as a K-quant file stores them (``SuperBlockScales``) are packed as they
    are, uint8 ``[N/16, K/256, bytes]`` (~0.08 byte a weight), and give the bits of the same
    numbers as float32 pairs: one row, 8, a GEMM's 40 and 40 row-invariant rows, and the rows
    read back; in bfloat16 (whose pairs would round them), the float32 result rounded once."""
    g = torch.Generator().manual_seed(11)
    n, k = 48, 768
    q, _ = fmt.quantize(torch.randn(n, k, generator=g))
    own_lows = fmt.name == "int6" and lows
    if own_lows:  # a Q5_K's 5 bits less 16, a Q2_K's 2 bits
        q = torch.randint(-shift, -shift + (32 if shift else 4), (n, k), generator=g)
        q = q.to(torch.int8)
    factored = _super_block_scales(fmt, n, k, lows, g, shift)
    packed, scales = fmt.pack(q, factored)
    assert scales.dtype == torch.uint8
    assert scales.shape == (n // 16, k // 256, (2 if lows else 1) * 16 * (2 + 256 // fmt.group))
    # fewer bytes than bfloat16 pairs or scales (0.08 against 0.125 byte a weight in groups of
    # 32, 0.14 against 0.25 with lows in groups of 16)
    assert scales.numel() <= k // fmt.group * n * 2 * (2 if lows else 1) * 0.625
    offset = 8 if fmt.name == "int4" else 0
    if not own_lows:  # else q + shift, not q + 32
        assert torch.equal(fmt.pack(q, factored.pairs(offset))[0], packed)
    # the pairs the kernel computes, (d sc, dlow m) or (d sc, -pack offset d sc), in float32
    # (the pack's pairs would compute low = zero - offset scale, another rounding)
    d = factored.d.repeat_interleave(256 // fmt.group, dim=0)
    scale = d[..., 0] * factored.sub[..., 0].float()
    low = d[..., 1] * factored.sub[..., 1].float() if lows else -fmt.pack_offset * scale
    pairs = torch.stack((scale, low), dim=-1).view(k // fmt.group, n // 16, 16, 2)
    pairs = pairs.transpose(0, 1).contiguous()
    x = torch.randn(40, k, generator=g)
    bias = torch.randn(n, generator=g)
    for rows, invariant in ((1, False), (8, False), (40, False), (40, True)):
        got = fmt.kernel(x[:rows], packed, scales, fmt.group, bias, invariant)
        assert torch.equal(got, fmt.kernel(x[:rows], packed, pairs, fmt.group, bias, invariant))
        if rows <= 32 or invariant:  # the integer path: the same float32 sums
            x16 = x[:rows].bfloat16()
            half = fmt.kernel(x16, packed, scales, fmt.group, None, invariant)
            want = fmt.kernel(x16.float(), packed, scales, fmt.group, None, invariant)
            assert torch.equal(half, want.bfloat16())
    name = "int4_rows" if fmt.name == "int4" else "int8_group_rows"
    ids = torch.tensor([47, 0, 17, 17, 31])
    got = getattr(fused, name)(packed, scales, ids, fmt.group)
    assert torch.equal(got, getattr(fused, name)(packed, pairs, ids, fmt.group))
    # the reference platform's pack takes them as pairs (its F.linear on float activations:
    # within the kernel's activation rounding)
    reference = fmt.reference(x[:3], *fmt.native_pack(q, factored), fmt.group)
    got = fmt.kernel(x[:3], packed, scales, fmt.group)
    assert (got - reference).abs().max() <= 1e-3 * reference.abs().max()


def test_super_block_scales_fall_back_to_pairs_where_they_cannot_hold_the_lows():
    """Int8 values held in 6 bits with lows of their own whose ``q + shift`` leaves 0..63 (the
    kernel's low would need a multiple of the scale too), and a ``d`` that is no float16
    number, get the pairs of the same numbers."""
    g = torch.Generator().manual_seed(12)
    fmt = GROUPED[3]  # int6, groups of 32
    q, _ = fmt.quantize(torch.randn(32, 256, generator=g))
    factored = _super_block_scales(fmt, 32, 256, True, g)
    packed, pairs = fmt.pack(q, factored)
    assert pairs.dtype == torch.float32 and pairs.dim() == 4
    assert torch.equal(pairs, fmt.pack(q, factored.pairs(0))[1])
    symmetric = _super_block_scales(fmt, 32, 256, False, g)
    inexact = SuperBlockScales(symmetric.d * (1 + 2.0**-13), symmetric.sub)
    assert fmt.pack(q, inexact)[1].dtype == torch.float32
    with pytest.raises(RuntimeError, match="super-block scales must be"):
        fmt.kernel(torch.randn(1, 256), packed, fmt.pack(q, symmetric)[1][:, :, :-1], fmt.group)


def test_int4_linear_refuses_what_it_cannot_compute():
    from pyxllm.layers.quantization import quantize_int4_groups

    q, scales_and_zeros = quantize_int4_groups(torch.randn(32, 64))
    packed, pairs = fused.pack_int4_weight(q, scales_and_zeros)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="groups of 32"):
        fused.int4_linear(x, packed, pairs, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        fused.int4_linear(x[:, :48], packed, pairs, 32)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        fused.int4_linear(x, packed, pairs.bfloat16(), 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        fused.int4_linear(x, packed[:, :100], pairs, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        fused.int4_linear(x, packed, pairs, 32, torch.zeros(5))
    with pytest.raises(ValueError, match="multiple of 16 output and 32 input"):
        fused.pack_int4_weight(q[:, :40], scales_and_zeros)


@pytest.mark.parametrize("rows", range(1, fused.SMALL_LINEAR_ROWS + 1))
def test_small_batch_linear_matches_native(rows):
    """1 to 8 float32 rows (K = 577: a tail past the 8-lane blocks), with and without bias,
    from a strided view; more rows (without ``batch_invariant``) or float16 take F.linear
    itself (bfloat16: ``test_bf16_linear_takes_the_kernel_where_it_should``)."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(301, 577, generator=g), torch.randn(301, generator=g)
    x = torch.randn(rows, 2, 577, generator=g)[:, 1]  # not contiguous
    # two float32 sums of the same 577 products in different orders differ by at most
    # (K + 1) * eps * sum |x_k w_k| (Higham, Accuracy and Stability, eq. 3.5); MKL's order
    # depends on the CPU, so the bound, not a fixed tolerance
    bound = (577 + 1) * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().t())
    for b in (None, bias):
        got, want = fused.linear(x, weight, b), native.linear(x, weight, b)
        assert got.shape == want.shape and bool(((got - want).abs() <= bound).all())
    batched = x.reshape(1, rows, 577)
    assert fused.linear(batched, weight).shape == (1, rows, 301)
    many = torch.randn(fused.SMALL_LINEAR_ROWS + 1, 577, generator=g)
    assert torch.equal(fused.linear(many, weight), native.linear(many, weight))
    half = x.half()
    assert torch.equal(fused.linear(half, weight.half()), native.linear(half, weight.half()))


def test_row_invariant_linear_gives_a_row_the_same_bits_at_any_row_count():
    """``batch_invariant``: float32 rows at any count (past the 6-row and 2-column register
    blocks, the 8-row small-batch bound and a 32-column task) each equal to that row alone, and
    within the summation-order bound of BLAS; MKL itself differs from M = 2 on here."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(75, 203, generator=g), torch.randn(75, generator=g)
    x = torch.randn(40, 203, generator=g)
    assert fused.linear_is_row_invariant(weight)
    assert fused.linear_is_row_invariant(weight.bfloat16())
    assert not fused.linear_is_row_invariant(weight.half())
    assert not fused.linear_is_row_invariant(weight.t())
    assert not fused.linear_is_row_invariant(weight.bfloat16().t())
    assert not native.linear_is_row_invariant(weight)
    alone = torch.cat([fused.linear(x[i : i + 1], weight, bias, True) for i in range(40)])
    bound = 204 * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().t() + bias.abs())
    assert bool(((alone - native.linear(x, weight, bias)).abs() <= bound).all())
    for rows in (2, 5, 6, 7, 9, 13, 40):
        got = fused.linear(x[:rows], weight, bias, batch_invariant=True)
        assert torch.equal(got, alone[:rows]), rows
    empty = fused.linear(x[:0], weight, bias, batch_invariant=True)
    assert empty.shape == (0, 75)


def _bf16_linear_in_order(x, weight, bias=None):
    """``bf16_rowwise_linear``'s documented order in float32 tensor arithmetic (each product of
    two bfloat16 values exact, each addition rounded to nearest): 16 lanes, lane l adding the
    odd then the even product of the pairs (32 c + 2 l, 32 c + 2 l + 1), inputs past K zeros;
    the lanes summed by halving, the bias added, the sum rounded to bfloat16."""
    k = x.shape[-1]
    padded = -(-k // 32) * 32
    xs = F.pad(x.float(), (0, padded - k)).view(x.shape[0], 1, padded // 32, 16, 2)
    ws = F.pad(weight.float(), (0, padded - k)).view(1, weight.shape[0], padded // 32, 16, 2)
    acc = torch.zeros(x.shape[0], weight.shape[0], 16)
    for c in range(padded // 32):
        acc = acc + xs[:, :, c, :, 1] * ws[:, :, c, :, 1]
        acc = acc + xs[:, :, c, :, 0] * ws[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:]
    total = acc[..., 0] if bias is None else acc[..., 0] + bias.float()
    return total.bfloat16()


def _expected_bf16_path() -> str:
    """The branch of ``bf16_rowwise_linear`` a build for this CPU and level compiles."""
    from pyxllm.kernels.cpu import build

    arch = build.target_arch()
    if arch != "native":
        return "avx2_fma" if arch in ("x86-64-v3", "x86-64-v4") else "generic"
    flags = cpu_flags()
    if {"avx512_bf16", "avx512bw"} <= flags:
        return "avx512_bf16"
    return "avx2_fma" if platform.machine() == "x86_64" and "fma" in flags else "generic"


@pytest.mark.parametrize("k", [203, 576])
def test_bf16_linear_is_its_documented_order_bit_for_bit(k):
    """``bf16_rowwise_linear`` on this build's branch (``vdpbf16ps``, AVX2 fused multiply-adds
    or plain vector code: the older ISA levels' runs of this file take the others) gives the
    bits of its order computed by torch: K = 203 with a tail past the 32-input steps, K = 576
    (SmolLM2's hidden size), past the 4x4 register blocks and a 64-row task, with a bias."""
    assert fused.bf16_linear_path() == _expected_bf16_path()
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(75, k, generator=g).bfloat16()
    bias = torch.randn(75, generator=g).bfloat16()
    x = torch.randn(9, k, generator=g).bfloat16()
    for b in (None, bias):
        got = fused.linear(x, weight, b, batch_invariant=True)
        assert got.dtype == torch.bfloat16 and torch.equal(got, _bf16_linear_in_order(x, weight, b))


def test_bf16_linear_gives_a_row_the_same_bits_at_any_row_count():
    """``batch_invariant`` on bfloat16: each row of a batch of 1, 3, 17 or 64 rows (row blocks
    of 4, a remainder, a 64-row panel) equals that row alone, and is within float32's
    summation-order bound plus bfloat16's rounding of the float32 product."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(150, 200, generator=g).bfloat16()
    bias = torch.randn(150, generator=g).bfloat16()
    x = torch.randn(64, 200, generator=g).bfloat16()
    alone = torch.cat([fused.linear(x[i : i + 1], weight, bias, True) for i in range(64)])
    for rows in (1, 3, 17, 64):
        assert torch.equal(fused.linear(x[:rows], weight, bias, True), alone[:rows]), rows
    want = x.float() @ weight.float().t() + bias.float()
    # float32 sums in another order (Higham eq. 3.5), then one rounding to bfloat16 (2^-9)
    order = 201 * torch.finfo(torch.float32).eps * (x.float().abs() @ weight.float().abs().t())
    bound = 2.0**-8 * (want.abs() + order) + order
    assert bool(((alone.float() - want).abs() <= bound).all())
    assert fused.linear(x[:0], weight, bias, True).shape == (0, 150)


def test_bf16_linear_takes_the_kernel_where_it_should():
    """bfloat16 over at most 8 rows, or any number with ``batch_invariant``, takes the
    row-wise kernel (faster than oneDNN there: ``SMALL_LINEAR_ROWS``); more rows without it
    take F.linear (oneDNN) itself; bad inputs raise naming the argument."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 96, generator=g).bfloat16()
    x = torch.randn(2, 12, 96, generator=g).bfloat16()[:, 3]  # a strided view
    assert torch.equal(fused.linear(x, weight), _bf16_linear_in_order(x, weight))
    assert fused.linear(x.reshape(1, 2, 96), weight).shape == (1, 2, 40)
    many = torch.randn(fused.SMALL_LINEAR_ROWS + 1, 96, generator=g).bfloat16()
    assert torch.equal(fused.linear(many, weight), native.linear(many, weight))
    assert torch.equal(fused.linear(many, weight, None, True), _bf16_linear_in_order(many, weight))
    ops = torch.ops.pyxllm_cpu
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16"):
        ops.bf16_rowwise_linear(x, weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[\.\.\., 96\]"):
        ops.bf16_rowwise_linear(x[:, :95], weight, None)
    with pytest.raises(RuntimeError, match="bias must be bfloat16"):
        ops.bf16_rowwise_linear(x, weight, torch.zeros(40))


def test_decode_attention_of_an_empty_row_is_zero():
    """A graph-padding row (``seq_len`` 0) attends to nothing and gets zeros, not NaN."""
    cache = torch.randn(4, 16, 1, 8)
    out = fused.paged_attention_decode(
        torch.randn(2, 2, 8),
        cache,
        cache,
        torch.zeros(2, 1, dtype=torch.long),
        torch.tensor([0, 3]),
        3,
        0.5,
    )
    assert torch.equal(out[0], torch.zeros(2, 8)) and torch.isfinite(out).all()


def test_bad_inputs_raise_clear_errors():
    cache = torch.randn(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.reshape_and_cache(
            torch.randn(1, 1, 8), torch.randn(1, 1, 8), cache, cache.clone(), torch.tensor([64])
        )
    with pytest.raises(RuntimeError, match="one slot a token"):
        fused.reshape_and_cache(
            torch.randn(2, 1, 8), torch.randn(2, 1, 8), cache, cache.clone(), torch.tensor([3])
        )
    with pytest.raises(RuntimeError, match="same heads and head_dim"):  # more heads than rows
        fused.reshape_and_cache(
            torch.randn(1, 2, 8), torch.randn(1, 2, 8), cache, cache.clone(), torch.tensor([63])
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.rms_norm(
            torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6
        )


# In a fresh interpreter: count the Python-level reads of /proc/cpuinfo.
_COUNT_CPUINFO_READS = (
    "import builtins; reads = []; real_open = builtins.open;"
    "builtins.open = lambda f, *a, **k: (reads.append(f) if 'cpuinfo' in str(f) else None)"
    " or real_open(f, *a, **k);"
)


def _run(code: str, **env: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "PYXLLM_CPU_DEFAULT_DTYPE"}
    subprocess.run(
        [sys.executable, "-c", _COUNT_CPUINFO_READS + code],
        env={**environ, **env},
        check=True,
        timeout=300,
    )


def test_binding_builds_the_kernels_importing_does_not():
    """Importing the CPU kernels and platforms builds nothing and reads no /proc/cpuinfo; binding
    the platform's kernels loads the fused ones in place of the native ones, and the platform's
    default dtype and the build share one read of the CPU's features."""
    _run(
        "import pyxllm.platforms as platforms, pyxllm.kernels.cpu as cpu;"
        "from pyxllm.kernels import native; from pyxllm.kernels.cpu import fused;"
        "assert fused.load.cache_info().currsize == 0 and reads == [], reads;"
        "assert cpu.rms_norm is native.rms_norm;"
        "platforms.set_current_platform(platforms.resolve_platform('cpu'));"
        "assert fused.load.cache_info().currsize == 1 and len(reads) == 1, reads;"
        "assert cpu.rms_norm is fused.rms_norm and cpu.w8a8_linear is fused.w8a8_linear;"
        "from pyxllm import kernels; assert kernels.ops is cpu"
    )


def test_native_kernels_when_asked():
    """``PYXLLM_CPU_KERNELS=native`` keeps the pure-PyTorch kernels (the fallback of a failed
    build) when the CPU's kernels are bound."""
    _run(
        "from pyxllm import kernels; from pyxllm.kernels import native;"
        "from pyxllm.kernels.cpu import fused;"
        "cpu = kernels.bind('pyxllm.kernels.cpu'); assert fused.load() is None;"
        "assert cpu.rms_norm is native.rms_norm and cpu.paged_attention_decode is "
        "native.paged_attention_decode;"
        "assert cpu.w8a8_linear is native.w8a8_linear",
        PYXLLM_CPU_KERNELS="native",
    )


def test_a_failed_build_falls_back_to_the_native_kernels():
    _run(
        "import torch.utils.cpp_extension as ext;"
        "ext.load = lambda **kw: (_ for _ in ()).throw(RuntimeError('no compiler'));"
        "from pyxllm import kernels; from pyxllm.kernels import native;"
        "cpu = kernels.bind('pyxllm.kernels.cpu');"
        "assert cpu.rms_norm is native.rms_norm and cpu.reshape_and_cache is "
        "native.reshape_and_cache"
    )


def test_a_failed_build_stops_the_test_suite():
    """Under pytest (tests/conftest.py), a build that fails is an error that names the cause,
    not a skip of the kernels' tests; ``PYXLLM_CPU_KERNELS=native`` runs the suite without."""
    code = (
        "import sys, pytest, torch.utils.cpp_extension as ext;"
        "ext.load = lambda **kw: (_ for _ in ()).throw(RuntimeError('error: no compiler here'));"
        "sys.exit(pytest.main(['-q', '-p', 'no:xdist', '-p', 'no:cacheprovider', "
        "'tests/kernels/test_cpu_fused_kernels.py::test_native_kernels_when_asked']))"
    )
    root = str(REPO_ROOT)
    for mode, want in (("fused", 4), ("native", 0)):  # 4: pytest's usage error
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYXLLM_CPU_KERNELS": mode},
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == want, run.stdout + run.stderr
        if mode == "fused":
            assert "fused CPU kernels do not build" in run.stderr + run.stdout
            assert "no compiler here" in run.stderr + run.stdout


def _older_levels() -> list[str]:
    """The x86-64 levels below this CPU's own that it runs, whose kernel branches a native
    build never compiles: x86-64-v2 (the plain vector code) everywhere, and x86-64-v3 (the
    AVX2 branches) where the CPU has AVX-512."""
    if platform.machine() != "x86_64":
        return []
    avx512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= cpu_flags()
    return ["x86-64-v2"] + (["x86-64-v3"] if avx512 else [])


@pytest.mark.parametrize("arch", _older_levels())
def test_the_kernels_on_an_older_isa_level(arch):
    """The kernels built for ``arch`` (``PYXLLM_CPU_KERNELS_ARCH``, its own build) pass this
    file's equivalence tests (fused against native, the grouped kernels' arithmetic and row
    invariance) and the int8 KV cache's kernel tests, in a process of their own (the engine
    runs and the tests that start processes themselves left out)."""
    root = str(REPO_ROOT)
    skip = " and ".join(
        f"not {name}"
        for name in ("older_isa_level", "failed_build", "binding_builds", "native_kernels",
                     "outputs_do_not_depend", "distributions_stay")
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "tests/kernels/test_cpu_fused_kernels.py", "tests/executor/test_kv_cache_int8.py",
         "-k", skip],
        env={**os.environ, "PYXLLM_CPU_KERNELS_ARCH": arch},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_isa_level_names_are_checked(monkeypatch):
    """``PYXLLM_CPU_KERNELS_ARCH``: the default is the host's own; a level names its own build
    (compile flags, hence build directory); a bad value is an error naming the variable, and
    ``pyxllm env``'s status shows it instead of failing."""
    from pyxllm.kernels.cpu import build

    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    assert build.target_arch() == "native" and "-march=native" in build.compile_flags()[0]
    native = build.extension_name()
    if platform.machine() == "x86_64":
        monkeypatch.setenv(build.ARCH_ENV, "x86-64-v2")
        assert "-march=x86-64-v2" in build.compile_flags()[0]
        assert build.extension_name() != native
    monkeypatch.setenv(build.ARCH_ENV, "pentium3")
    with pytest.raises(ValueError, match="PYXLLM_CPU_KERNELS_ARCH='pentium3'"):
        build.compile_flags()
    status = build.build_status()
    assert status["arch"] == "pentium3" and "must be one of" in status["status"]


def _lora_layer(gen, k: int, modules: list[tuple[int, int, int]], dtype):
    """One adapter's layer in ``lora_delta``'s layout: ``modules`` as ``(out_start, out_len,
    rank)``, random weights, rank padded to 8 with zero columns of ``a``."""
    total = sum(r for _, _, r in modules)
    a = torch.zeros(k, -(-total // 8) * 8)
    a[:, :total] = torch.randn(k, total, generator=gen)
    blocks, segments, rank_start, b_offset = [], [], 0, 0
    for out_start, out_len, rank in modules:
        blocks.append(torch.randn(rank * out_len, generator=gen))
        segments.append((out_start, out_len, rank_start, rank, b_offset))
        rank_start, b_offset = rank_start + rank, b_offset + rank * out_len
    return a.to(dtype), torch.cat(blocks).to(dtype), torch.tensor(segments)


def _lora_rows_alone_and_together(y0, x, a, b, segments, row_adapter):
    """``y0`` plus the fused ``lora_delta`` of all rows in one call, after asserting that each
    row, called alone, gets the same bits."""
    y = y0.clone()
    fused.lora_delta(y, x, a, b, segments, row_adapter)
    for m in range(len(x)):
        alone = y0[m : m + 1].clone()
        fused.lora_delta(alone, x[m : m + 1], a, b, segments, row_adapter[m : m + 1].clone())
        assert torch.equal(alone, y[m : m + 1]), m
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_adds_each_rows_own_adapter_with_bits_of_its_own(dtype):
    """Rows on three adapters (one with three modules and a column tail, one not adapting the
    layer) and rows on none, in one call: each row gets the bits it gets alone, in a block
    of rows on its adapter or with them in another order; within float32 rounding of the
    native reference; rows on none, and on the adapter without the layer, are left as they
    were. A segment outside b is refused."""
    gen = torch.Generator().manual_seed(0)
    k, n = 77, 50
    layers = [
        _lora_layer(gen, k, [(0, 20, 8), (20, 13, 4), (33, 17, 8)], dtype),
        (torch.empty(0, 0, dtype=dtype), torch.empty(0, dtype=dtype), torch.empty(0, 5).long()),
        _lora_layer(gen, k, [(3, 40, 5)], dtype),
        _lora_layer(gen, k, [(0, 50, 24)], dtype),
    ]
    a, b, segments = (list(t) for t in zip(*layers))
    x = torch.randn(11, k, generator=gen).to(dtype)
    y0 = torch.randn(11, n, generator=gen).to(dtype)
    row_adapter = torch.tensor([3, -1, 0, 1, 0, 2, 3, 0, 3, 0, 0])
    y = _lora_rows_alone_and_together(y0, x, a, b, segments, row_adapter)
    order = torch.tensor([10, 4, 2, 0, 1, 5, 3, 6, 9, 7, 8])
    shuffled = y0[order].contiguous()
    fused.lora_delta(shuffled, x[order].contiguous(), a, b, segments, row_adapter[order].clone())
    assert torch.equal(shuffled, y[order])
    assert torch.equal(y[[1, 3]], y0[[1, 3]])
    assert not torch.equal(y[[0, 2, 5]], y0[[0, 2, 5]])
    want = y0.clone()
    native.lora_delta(want, x, a, b, segments, row_adapter)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(y, want, **tolerance)
    bad = segments[0].clone()
    bad[0, 4] = b[0].numel()
    with pytest.raises(RuntimeError, match="segment 0 falls outside"):
        fused.lora_delta(y, x, a, b, [bad, *segments[1:]], row_adapter)


@pytest.mark.parametrize("k", [130, 131])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_keeps_a_rows_bits_in_wide_modules_and_prefill_blocks(dtype, k):
    """Modules 64 columns and wider (the expand's widest tiles) and inputs k of 2 and 3 past a
    multiple of 4 (the shrink's last pairs): 13 rows on one adapter, in a call of their own
    and in blocks of 4, get each row's bits alone, within float32 rounding of the native
    reference."""
    gen = torch.Generator().manual_seed(1)
    n = 230
    layers = [
        _lora_layer(gen, k, [(0, 130, 16), (130, 100, 8)], dtype),
        _lora_layer(gen, k, [(0, 230, 8)], dtype),
    ]
    a, b, segments = (list(t) for t in zip(*layers))
    x = torch.randn(14, k, generator=gen).to(dtype)
    y0 = torch.randn(14, n, generator=gen).to(dtype)
    row_adapter = torch.tensor([0] * 13 + [1])
    y = _lora_rows_alone_and_together(y0, x, a, b, segments, row_adapter)
    want = y0.clone()
    native.lora_delta(want, x, a, b, segments, row_adapter)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(y, want, **tolerance)
