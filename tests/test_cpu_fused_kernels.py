"""The fused C++ CPU kernels (``pyxllm.kernels.cpu.fused``) against the pure-PyTorch reference.

Tolerances: in float32 the kernels differ from the reference only in summation order and the
last bits of exp (a few ulp); in bfloat16, where the reference rounds intermediates to bf16,
the kernels round at the same places, so elementwise ops agree exactly and attention (whose
scores and probabilities the kernel keeps in float32) within bf16 rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pyxllm.kernels import native
from pyxllm.kernels.cpu import fused

pytestmark = pytest.mark.skipif(
    fused.load() is None, reason="the fused CPU kernels could not be built here"
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_linear_matches_native_exactly(dtype):
    """Same int8 activations, exact int32 sums and the same float32 rescaling: bit-equal, also
    for a row of zeros, a bias, odd sizes, a Hadamard transform first, a 3-D strided input and
    no rows at all."""
    from pyxllm.layers.quantization import quantize_int8_per_channel

    g = torch.Generator().manual_seed(2)
    for rows, k, n in [(1, 576, 960), (64, 1536, 576), (3, 40, 24), (0, 64, 32)]:
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


@pytest.mark.parametrize("rows", range(1, fused.SMALL_LINEAR_ROWS + 1))
def test_small_batch_linear_matches_native(rows):
    """1 to 8 float32 rows (K = 577: a tail past the 8-lane blocks), with and without bias,
    from a strided view; more rows or bfloat16 take F.linear itself."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 577, generator=g), torch.randn(300, generator=g)
    x = torch.randn(rows, 2, 577, generator=g)[:, 1]  # not contiguous
    # two float32 sums of the same 577 products in different orders differ by at most
    # (K + 1) * eps * sum |x_k w_k| (Higham, Accuracy and Stability, eq. 3.5); MKL's order
    # depends on the CPU, so the bound, not a fixed tolerance
    bound = (577 + 1) * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().t())
    for b in (None, bias):
        got, want = fused.linear(x, weight, b), native.linear(x, weight, b)
        assert got.shape == want.shape and bool(((got - want).abs() <= bound).all())
    batched = x.reshape(1, rows, 577)
    assert fused.linear(batched, weight).shape == (1, rows, 300)
    many = torch.randn(fused.SMALL_LINEAR_ROWS + 1, 577, generator=g)
    assert torch.equal(fused.linear(many, weight), native.linear(many, weight))
    half = x.bfloat16()
    assert torch.equal(
        fused.linear(half, weight.bfloat16()), native.linear(half, weight.bfloat16())
    )


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
