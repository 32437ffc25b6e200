"""Fused CPU kernels (``csrc/cpu_kernels.cpp``), built by :func:`load` (when the CPU platform
binds ``pyxllm.kernels.cpu``) with PyTorch's C++ extension loader, behind the signatures of
``pyxllm.kernels.native``.

Why: on a CPU, a batch-1 decode step is mostly per-op overhead, not arithmetic. Each native
RMSNorm, rotary embedding or decode attention is a chain of 5-15 small ATen ops (a few
microseconds each, several tens for small bfloat16 matmuls), repeated in every layer; one fused
call per op took SmolLM2-135M's int4 batch-1 decode step from 18 to 10 ms on 2 cores
(docs/performance.md). vLLM's CPU backend fuses the same ops (its ``csrc/cpu``); ours are plain
loops and GCC/Clang vector extensions that the compiler vectorizes, in float32 and bfloat16.

One is ``linear``, float32 (``rowwise_linear`` in ``csrc/cpu_kernels.cpp``) and bfloat16
(``bf16_rowwise_linear`` in ``csrc/bf16_linear.cpp``): each output summed in a fixed order
whatever the row count, so it serves ``--batch-invariant`` at any row count, and without it 1 to
8 rows (a small decode batch, a sequence verifying speculative drafts), where it reads each
weight row once for all rows. On the development machine's AVX2 CPU, over weights streaming
from memory as a model's do (30 layers of SmolLM2's projections, 424 MB of float32), MKL took
53 ms for one row and 101 ms for five; the float32 kernel's first version 26 and 34 ms. Over
hundreds of rows (a prefill) it reaches ~0.75-0.85x MKL's GFLOP/s on one core; the bfloat16
one, on AVX512-BF16, ~0.85-1.0x oneDNN's (and ~3x at one row).

Two are ``int4_linear`` and ``int8_group_linear`` (``csrc/group_linear.cpp``), the matmuls of
``--quantization int4`` and of GGUF weights kept as stored: int8 activations in two parts and
integer dot products, one pass over the weights for up to 8 rows.

The library is built on first use and cached (``pyxllm.kernels.cpu.build``). Where that fails
(no compiler, a stale lock), :func:`load` returns ``None`` after one warning, and with
``PYXLLM_CPU_KERNELS=native`` without trying; the CPU platform then keeps the native kernels.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

import pyxllm.kernels.cpu.build as build  # the module, not the package (which imports this one)
from pyxllm.kernels import native
from pyxllm.kernels.native.quantized import SuperBlockScales, dequantize_groups

logger = logging.getLogger(__name__)

# the kernels below, bound in place of the native ones of the same names
KERNELS = (
    "apply_rotary_emb",
    "fused_add_rms_norm",
    "int4_linear",
    "int4_rows",
    "int8_group_linear",
    "int8_group_rows",
    "linear",
    "linear_is_row_invariant",
    "lora_delta",
    "pack_int4_weight",
    "pack_int8_group_weight",
    "paged_attention_decode",
    "reshape_and_cache",
    "rms_norm",
    "silu_and_mul",
    "w8a8_linear",
)


def _register_fakes() -> None:
    """Shape-only implementations, so the ops can appear in ``torch.compile`` graphs."""
    lib = "pyxllm_cpu::"

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "fused_add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(lib + "silu_and_mul")
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.register_fake(lib + "apply_rotary_emb")
    def _(q, k, cos, sin):
        return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
            k, memory_format=torch.contiguous_format
        )

    @torch.library.register_fake(lib + "paged_attention_decode")
    def _(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=0, key_lens=None):
        return query.new_empty(query.shape)

    @torch.library.register_fake(lib + "w8a8_linear")
    def _(x, qweight, weight_scales, bias, hadamard_block=0):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])

    @torch.library.register_fake(lib + "lora_delta")
    def _(y, x, a, b, segments, row_adapter):
        return None

    @torch.library.register_fake(lib + "rowwise_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake(lib + "bf16_rowwise_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake(lib + "int4_linear")
    def _(x, packed, scales_and_zeros, group_size, bias, batch_invariant=False):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * INT4_TILE)

    @torch.library.register_fake(lib + "int8_group_linear")
    def _(x, packed, scales_and_zeros, group_size, bias, batch_invariant=False):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * INT4_TILE)


@functools.cache
def load():
    """``torch.ops.pyxllm_cpu`` with the fused kernels built and loaded, or ``None`` (see the
    module docstring); tried at most once per process."""
    if os.environ.get(build.MODE_ENV, "fused") == "native":
        logger.info("%s=native: using the pure-PyTorch CPU kernels", build.MODE_ENV)
        return None
    try:
        build.build_and_load()
        _register_fakes()
        return torch.ops.pyxllm_cpu
    except Exception as exc:  # noqa: BLE001 - any build failure means: fall back to native
        logger.warning(
            "fused CPU kernels unavailable (%s: %s); using the pure-PyTorch ones (slower)",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None


# The kernels under ``pyxllm.kernels.native``'s names and signatures (:data:`KERNELS`, bound by
# ``pyxllm.kernels.cpu.on_bind`` once :func:`load` succeeded).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See ``pyxllm.kernels.native.rms_norm`` (``x [..., hidden]``, float32 or bfloat16)."""
    return torch.ops.pyxllm_cpu.rms_norm.default(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``pyxllm.kernels.native.fused_add_rms_norm``; both results are new tensors."""
    return torch.ops.pyxllm_cpu.fused_add_rms_norm.default(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See ``pyxllm.kernels.native.silu_and_mul`` (``[..., 2d] -> [..., d]``)."""
    return torch.ops.pyxllm_cpu.silu_and_mul.default(x)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``pyxllm.kernels.native.apply_rotary_emb``; ``q``/``k`` may be strided views (the
    split of a fused QKV output), the results are contiguous."""
    return torch.ops.pyxllm_cpu.apply_rotary_emb.default(q, k, cos, sin)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See ``pyxllm.kernels.native.reshape_and_cache``; K/V must already be in the cache's dtype.

    Raises:
        RuntimeError: a slot outside the cache, or a dtype mismatch.
    """
    torch.ops.pyxllm_cpu.reshape_and_cache.default(key, value, k_cache, v_cache, slot_mapping)


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
    """See ``pyxllm.kernels.native.paged_attention_decode``. Each row attends to exactly its
    ``seq_lens[b]`` tokens (its last ``sliding_window`` of them), or with ``key_lens`` (``int64
    [batch]``, each at least its ``seq_lens``: the tokens of an image attended bidirectionally,
    Gemma 3's, under ``--batch-invariant``) to positions up to ``key_lens[b]``, the window still
    counted back from ``seq_lens[b]``; so ``max_seq_len`` and ``attn_mask`` are not needed (a
    row of length 0, graph padding, gets zeros). Each row's sums run over its own keys in an
    order set by its own length alone (in bfloat16 on AVX512-BF16, a row of more than 256 keys
    in chunks of 256, combined in order as flash-decoding does), so its bits do not depend on
    the other rows. Soft-capped layers (Gemma 2) take the
    native kernel.

    Raises:
        RuntimeError: a ``key_lens`` not ``[batch]``, below ``seq_lens`` or past the block
            table.
    """
    if logits_soft_cap is not None:
        return native.paged_attention_decode(
            query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, attn_mask,
            sliding_window, logits_soft_cap, key_lens,
        )  # fmt: skip
    if key_lens is None:  # a text-only step's call: one argument fewer to parse
        return torch.ops.pyxllm_cpu.paged_attention_decode.default(
            query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0
        )
    return torch.ops.pyxllm_cpu.paged_attention_decode.default(
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0, key_lens
    )


# rows up to which ``linear`` takes the C++ kernels even without ``batch_invariant``: they read
# each weight row once for all rows, where MKL's float32 GEMM over 2-8 rows costs ~2.3x its
# GEMV, and oneDNN's bfloat16 one on a Zen 4 core (AVX512-BF16) ran at a third of the row-wise
# kernel's speed at one row and 0.6x at 8 (its AVX2 branch: 0.5x at one row; docs/defaults.md)
SMALL_LINEAR_ROWS = 8


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.linear``. A contiguous float32 or bfloat16 weight with ``x``
    (and ``bias``) of its dtype takes the C++ kernel over at most :data:`SMALL_LINEAR_ROWS`
    rows, and over any number with ``batch_invariant``: each output's sum in a fixed order, so a
    row gets the same bits at any row count. float32: ``rowwise_linear`` (float32 sums in
    another order than BLAS, results agree to ~1e-6 relative); bfloat16: ``bf16_rowwise_linear``
    (float32 sums, the output rounded to bfloat16 once, as oneDNN's; on AVX512-BF16 CPUs with
    ``vdpbf16ps``, elsewhere the same bits from fused multiply-adds). Anything else
    ``F.linear``."""
    if (
        linear_is_row_invariant(weight)
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and 0 < x.numel()
        and (batch_invariant or x.numel() <= SMALL_LINEAR_ROWS * x.shape[-1])
    ):
        if weight.dtype == torch.bfloat16:
            return torch.ops.pyxllm_cpu.bf16_rowwise_linear.default(x, weight, bias)
        return torch.ops.pyxllm_cpu.rowwise_linear.default(x, weight, bias)
    return native.linear(x, weight, bias)


def linear_is_row_invariant(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` with ``batch_invariant`` gives a row the same bits at any row
    count for inputs of ``weight``'s dtype: a contiguous float32 or bfloat16 weight (float16,
    and a transposed view, take ``F.linear``, which does not)."""
    return weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()


def bf16_linear_path() -> str:
    """Which branch of ``bf16_rowwise_linear`` this build compiled: ``avx512_bf16``
    (``vdpbf16ps``), ``avx2_fma`` or ``generic`` (plain vector code); the same bits on each."""
    return torch.ops.pyxllm_cpu.bf16_linear_path()


def lora_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    segments: list[torch.Tensor],
    row_adapter: torch.Tensor,
) -> None:
    """See ``pyxllm.kernels.native.lora_delta``: one call for every adapter of a step, rows on
    one adapter computed together, each output's sum one fused multiply-add per term in a
    fixed order in a vector lane of its own, so a row's bits do not depend on the other rows.

    Raises:
        RuntimeError: tensors of other dtypes, layouts or shapes, a segment outside ``y``, ``a``
            or ``b``, or a row naming an adapter that is not there.
    """
    torch.ops.pyxllm_cpu.lora_delta.default(y, x, a, b, segments, row_adapter)


def w8a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    hadamard_block: int = 0,
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.w8a8_linear``: the same int8 activations and int32 sums
    (``torch._int_mm``, oneDNN's VNNI kernels), with the Hadamard transform, quantization and
    rescaling fused around it.

    Raises:
        RuntimeError: ``qweight`` not int8 ``[N, K]``, ``weight_scales`` not float32 ``[N]``, a
            ``hadamard_block`` that is not a power of two dividing ``K``.
    """
    return torch.ops.pyxllm_cpu.w8a8_linear.default(x, qweight, weight_scales, bias, hadamard_block)


# output features per tile of ``int4_linear``'s packed weights (its kTile)
INT4_TILE = 16


def _pack_pairs(
    scales_and_zeros: torch.Tensor, offset: int, tiles: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The kernels' pairs: ``scales_and_zeros`` (``[G, N, 2]``, ``W = (q - offset) * scale +
    zero``) as ``[N/16, G, 16, 2]`` ``(scale, low)`` with ``low = zero - offset * scale`` (what
    ``q = 0`` stands for, computed in float32); where every zero is 0 (GGUF's Q4_0, Q8_0 and
    K-quant Q6_K, Q3_K blocks: ``W = (q - offset) * scale``) the scales alone, ``[N/16, G, 16]``,
    the kernel computing ``low = -offset * scale`` itself (exact: ``offset`` is 8 or 0). In
    float16 where that holds every number exactly (a Q4_0, Q4_1 or Q8_0 file's, handed over in
    float32), else in ``dtype`` (``None``: ``scales_and_zeros.dtype``)."""
    groups = scales_and_zeros.shape[0]
    scale, zero = scales_and_zeros.float().unbind(-1)
    if zero.any():
        pairs = torch.stack((scale, zero - offset * scale), dim=-1)
        shape: tuple[int, ...] = (groups, tiles, INT4_TILE, 2)
    else:
        pairs, shape = scale, (groups, tiles, INT4_TILE)
    half = pairs.to(torch.float16)
    if torch.equal(half.float(), pairs):
        pairs = half
    else:
        pairs = pairs.to(dtype or scales_and_zeros.dtype)
    return pairs.view(shape).transpose(0, 1).contiguous()


# input features per super-block of :class:`SuperBlockScales` (the kernel's kSuperInputs)
SUPER_BLOCK = 256


def _pack_scales(
    scales_and_zeros: torch.Tensor | SuperBlockScales,
    offset: int,
    format_offset: int,
    tiles: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The kernels' scales for weights whose packed ``q`` stands for ``(q - offset) * scale +
    zero`` (int4 8, int8 0, int6 32) and whose format's for ``(q - format_offset) * scale +
    zero`` (int4 8, int8 0): :func:`_pack_super_blocks` where ``scales_and_zeros`` is a
    :class:`SuperBlockScales` that layout holds, else :func:`_pack_pairs` (pairs not held in
    float16 in ``dtype``; ``None``: the pairs' own, a :class:`SuperBlockScales`' float32)."""
    if isinstance(scales_and_zeros, SuperBlockScales):
        packed = _pack_super_blocks(scales_and_zeros, offset, format_offset, tiles)
        if packed is not None:
            return packed
        scales_and_zeros = scales_and_zeros.pairs(format_offset)
    return _pack_pairs(scales_and_zeros, offset, tiles, dtype)


def _pack_super_blocks(
    scales: SuperBlockScales, offset: int, format_offset: int, tiles: int
) -> torch.Tensor | None:
    """``scales`` as the kernels' super-block scales (``csrc/group_linear.cpp``,
    SuperBlockCursor): uint8 ``[N/16, K/256, P * 16 * (2 + S)]``, per tile and super-block the
    16 lanes' float16 ``d`` (then ``dlow``), then per group the 16 lanes' int8 ``sc`` (then
    ``m``), ``S = 256 / G`` groups. The kernel computes ``scale = d sc`` and ``low = dlow m``
    (what the packed ``q = 0`` stands for), or with ``P = 1`` ``low = -offset scale``; ``None``
    where that is not these weights' low (the packed ``q``, the format's plus ``offset -
    format_offset``, must be ``q + shift`` less the kernel's offset) or a ``d`` is not a
    float16 number."""
    per_lane = scales.d.shape[-1]
    kernel_offset = 0 if per_lane == 2 else offset
    if offset - format_offset - kernel_offset != scales.shift:
        return None
    half = scales.d.to(torch.float16)
    if not torch.equal(half.float(), scales.d.float()):
        return None
    supers, groups = scales.d.shape[0], scales.sub.shape[0]
    per = groups // supers
    # [super, tile, lane, p] -> [tile, super, p, lane], two bytes a number
    head = half.view(supers, tiles, INT4_TILE, per_lane).permute(1, 0, 3, 2).contiguous()
    head = head.view(torch.uint8).reshape(tiles, supers, -1)
    # [super, group, tile, lane, p] -> [tile, super, group, p, lane]
    sub = scales.sub.to(torch.int8).view(supers, per, tiles, INT4_TILE, per_lane)
    sub = sub.permute(2, 0, 1, 4, 3).contiguous().view(torch.uint8).reshape(tiles, supers, -1)
    return torch.cat((head, sub), dim=-1).contiguous()


def _float16_bits(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The float16 numbers whose little-endian bytes are ``lo``, ``hi`` (uint8), in float32,
    exactly, by arithmetic (the graph runner's TorchScript trace records no dtype view)."""
    bits = lo.to(torch.int32) | (hi.to(torch.int32) << 8)
    exponent, mantissa = (bits >> 10) & 0x1F, bits & 0x3FF
    normal = exponent > 0  # else a subnormal (or zero): mantissa * 2^-24
    value = torch.ldexp(
        (mantissa + normal.to(torch.int32) * 1024).float(),
        torch.where(normal, exponent - 25, torch.full_like(exponent, -24)).float(),
    )
    return torch.where(bits >= 0x8000, -value, value)


def _unpacked_super_blocks(
    scales: torch.Tensor, tile, lane, offset: int, group_size: int
) -> torch.Tensor:
    """:func:`_unpacked_pairs` of :func:`_pack_super_blocks`' bytes."""
    tiles, supers, nbytes = scales.shape
    per = SUPER_BLOCK // group_size
    per_lane = nbytes // (INT4_TILE * (2 + per))
    head = scales[tile, :, : 2 * INT4_TILE * per_lane]  # [n, super, 2 * 16 * P]
    head = head.reshape(len(tile), supers, per_lane, INT4_TILE, 2)
    lanes = torch.arange(len(tile))
    head = head[lanes, :, :, lane]  # [n, super, P, 2]
    d = _float16_bits(head[..., 0], head[..., 1])  # [n, super, P]
    sub = scales[tile, :, 2 * INT4_TILE * per_lane :].reshape(
        len(tile), supers, per, per_lane, INT4_TILE
    )[lanes, :, :, :, lane]  # [n, super, group, P] as uint8
    sub = sub.to(torch.int32) - (sub >= 128).to(torch.int32) * 256
    scale = (d[:, :, None, 0] * sub[..., 0].float()).reshape(len(tile), -1)
    if per_lane == 2:
        low = (d[:, :, None, 1] * sub[..., 1].float()).reshape(len(tile), -1)
    else:
        low = -offset * scale
    return torch.stack((scale, low), dim=-1).transpose(0, 1)


def _unpacked_pairs(
    scales_and_zeros: torch.Tensor, tile, lane, offset: int, group_size: int
) -> torch.Tensor:
    """The ``(scale, low)`` pairs ``[G, n, 2]`` float32 of the output features at ``(tile,
    lane)`` (each ``[n]``), from :func:`_pack_pairs`' pairs or scales (``low = -offset *
    scale``), or :func:`_pack_super_blocks`' bytes."""
    if scales_and_zeros.dtype == torch.uint8:
        return _unpacked_super_blocks(scales_and_zeros, tile, lane, offset, group_size)
    if scales_and_zeros.dim() == 4:
        return scales_and_zeros[tile, :, lane, :].transpose(0, 1).float()
    scale = scales_and_zeros[tile, :, lane].t().float()
    return torch.stack((scale, -offset * scale), dim=-1)


def pack_int4_weight(
    q: torch.Tensor,
    scales_and_zeros: torch.Tensor | SuperBlockScales,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (``[N, K]``, values ``0..15``) and ``scales_and_zeros`` (``[K/32, N, 2]``) in
    :func:`int4_linear`'s layout, tiles of 16 output features with each tile's groups of 32
    input features one after the other (``csrc/group_linear.cpp``): ``[N/16, 8 K]`` uint8, two
    weights a byte, and ``[N/16, K/32, 16, 2]`` (scale, low) pairs, ``W = q * scale + low``, in
    float16 where that is exact, else in ``dtype``, the compute dtype (``None``:
    ``scales_and_zeros.dtype``; hand exact pairs over in float32, since pairs rounded to
    bfloat16 are no longer a file's float16 numbers); ``[N/16, K/32, 16]`` scales alone where
    every zero is 0 (:func:`_pack_pairs`). Scales factored as a K-quant file
    stores them (a :class:`SuperBlockScales`, GGUF's Q4_K) are held so, uint8 ``[N/16, K/256,
    320]`` (:func:`_pack_super_blocks`).

    Raises:
        ValueError: ``N`` not a multiple of 16 or ``K`` not a multiple of 32.
    """
    n, k = q.shape
    if n % INT4_TILE or k % 32:
        raise ValueError(
            f"int4 weights need a multiple of {INT4_TILE} output and 32 input features on CPU, "
            f"got {n} x {k}"
        )
    tiles, groups = n // INT4_TILE, k // 32
    # [tile, lane, group, chunk, nibble, byte] -> [tile, group, chunk, lane, byte, nibble]
    t = q.to(torch.uint8).view(tiles, INT4_TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (t[..., 0] | (t[..., 1] << 4)).contiguous().view(tiles, k * INT4_TILE // 2)
    return packed, _pack_scales(scales_and_zeros, 8, 8, tiles, dtype)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``pyxllm.kernels.native.int4_linear``'s weights with int8 activations (W4A8) up to 32
    rows: each row's groups of 32 activations quantized to two int8 parts (~15 bits), integer
    dot products per group (VNNI where the CPU has it), see ``csrc/group_linear.cpp``. One pass
    over the weights serves up to 8 rows, and a row's result does not depend on the other rows.
    Above 32 rows, the dequantized weights in a BLAS GEMM, unless ``batch_invariant``: then the
    integer path at any row count, so a row gets the same bits in a batch of any size (a prompt
    prefilled at once, in chunks, or a token decoded among 100 others).

    Args:
        x: ``[..., K]`` float32 or bfloat16; packed, scales_and_zeros: from
            :func:`pack_int4_weight`, packed from pairs in ``x.dtype``; group_size: 32; bias:
            ``[N]`` or None; batch_invariant: see above.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    Raises:
        RuntimeError: a shape, dtype or group size the kernel does not take.
    """
    return torch.ops.pyxllm_cpu.int4_linear.default(
        x, packed, scales_and_zeros, group_size, bias, batch_invariant
    )


def int4_rows(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, ids: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Rows ``ids`` of the weight :func:`pack_int4_weight` stored, dequantized in float32:
    ``[len(ids), K]``, read out of its tiles (``pyxllm.kernels.native.int4_rows``' contract).

    Raises:
        ValueError: ``group_size`` not 32.
    """
    if group_size != 32:
        raise ValueError(f"int4_rows: groups of 32 input features only, got {group_size}")
    tiles, k = packed.shape[0], packed.shape[1] * 2 // INT4_TILE
    tile, lane = ids // INT4_TILE, ids % INT4_TILE
    # [tile, group, chunk, lane, byte] at (tile, lane) -> [n, group, chunk, byte]: a byte's low
    # nibble is input 8 chunk + byte of the group, its high nibble input 8 chunk + 4 + byte
    b = packed.view(tiles, k // 32, 4, INT4_TILE, 4)[tile, :, :, lane, :]
    q = torch.stack((b & 0xF, b >> 4), dim=-2).reshape(len(ids), k)
    pairs = _unpacked_pairs(scales_and_zeros, tile, lane, 8, group_size)
    return dequantize_groups(q, pairs, group_size)


def int8_group_rows(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, ids: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Rows ``ids`` of the weight :func:`pack_int8_group_weight` stored, dequantized in float32:
    ``[len(ids), K]`` (groups of ``group_size``, 32 or 16), read out of its tiles (int8 or
    6-bit)."""
    tiles, g = packed.shape[0], group_size
    tile, lane = ids // INT4_TILE, ids % INT4_TILE
    if scales_and_zeros.dtype == torch.uint8:  # super-block scales
        k = scales_and_zeros.shape[1] * SUPER_BLOCK
    else:
        k = scales_and_zeros.shape[1] * g
    if packed.shape[1] != k * INT4_TILE:  # 6 bits: 12 bytes a tile per input feature
        b = packed.view(tiles, k // g, g // 8 + g // 16, INT4_TILE, 4)[tile, :, :, lane, :]
        nibbles = b[:, :, : g // 8]  # [n, K/G, G/8 chunks, 4 bytes]
        low = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-2).reshape(len(ids), k // g, g)
        top = b[:, :, g // 8 :, None, :] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        u = low | ((top & 3).reshape(len(ids), k // g, g) << 4)
        pairs = _unpacked_pairs(scales_and_zeros, tile, lane, 32, g)
        return dequantize_groups(u.reshape(len(ids), k), pairs, group_size)
    q = packed.view(tiles, k // 32, 8, INT4_TILE, 4)[tile, :, :, lane, :].reshape(len(ids), k)
    pairs = _unpacked_pairs(scales_and_zeros, tile, lane, 0, g)
    # the int8 bits as uint8 with the sign bit flipped are q + 128 (no dtype view: TorchScript's
    # trace, the graph runner's capture, cannot record one)
    return dequantize_groups(q ^ 0x80, pairs, group_size, offset=128)


def pack_int8_group_weight(
    q: torch.Tensor,
    scales_and_zeros: torch.Tensor | SuperBlockScales,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (``[N, K]`` int8) and ``scales_and_zeros`` (``[K/G, N, 2]``, groups of G = 32 or 16
    input features) in :func:`int8_group_linear`'s layout, tiles of 16 output features with each
    tile's groups of 32 input features one after the other, four input features of a lane
    together (``csrc/group_linear.cpp``): ``[N/16, 16 K]`` uint8 (the int8 bits) and ``[N/16,
    K/G, 16, 2]`` (scale, low) pairs, in float16 where that is exact (else in ``dtype``, as
    :func:`pack_int4_weight`'s), or ``[N/16, K/G, 16]`` scales alone where every zero is 0
    (:func:`_pack_pairs`); scales factored as a K-quant file
    stores them (a :class:`SuperBlockScales`: GGUF's K-quants, IQ4_XS) as uint8 ``[N/16,
    K/256, bytes]`` (:func:`_pack_super_blocks`, which falls back to pairs where it cannot
    hold them).

    Where every ``q`` lies in -32..31 (GGUF's Q6_K, Q5_x, Q3_K, Q2_K) it is packed in 6 bits
    instead, as ``q + 32``, ``[N/16, 12 K]`` (the kernel's Int6Format: per group, G/8 chunks of
    nibbles as :func:`pack_int4_weight`'s, then G/16 chunks of the top bit pairs), with ``low =
    zero - 32 scale``: three quarters of the bytes to read (``q + shift`` with factored scales
    that have lows of their own, a Q5_K's or Q2_K's: :func:`_super_blocks_in_six_bits`).

    Raises:
        ValueError: ``N`` not a multiple of 16, ``K`` not a multiple of 32, or G not 32 or 16.
    """
    n, k = q.shape
    if isinstance(scales_and_zeros, SuperBlockScales):
        groups = scales_and_zeros.sub.shape[0]
    else:
        groups = scales_and_zeros.shape[0]
    if n % INT4_TILE or k % 32 or groups * 32 not in (k, 2 * k):
        raise ValueError(
            f"grouped int8 weights need a multiple of {INT4_TILE} output and 32 input features "
            f"on CPU, in groups of 32 or 16, got {n} x {k} in {groups} groups"
        )
    tiles = n // INT4_TILE
    q = q.to(torch.int8)
    lo, hi = (int(v) for v in torch.aminmax(q)) if q.numel() else (0, 0)
    if q.numel() and -32 <= lo and hi <= 31:
        held = _super_blocks_in_six_bits(lo, hi, scales_and_zeros, tiles)
        if held is not None:
            return _pack_six_bits(q, k // groups, tiles, scales_and_zeros.shift), held
        pairs = _pack_scales(scales_and_zeros, 32, 0, tiles, dtype)
        return _pack_six_bits(q, k // groups, tiles), pairs
    # [tile, lane, group of 32, chunk, byte] -> [tile, group of 32, chunk, lane, byte]
    t = q.view(torch.uint8).view(tiles, INT4_TILE, k // 32, 8, 4)
    packed = t.permute(0, 2, 3, 1, 4).contiguous().view(tiles, k * INT4_TILE)
    return packed, _pack_scales(scales_and_zeros, 0, 0, tiles, dtype)


def _super_blocks_in_six_bits(
    lo: int, hi: int, scales: torch.Tensor | SuperBlockScales, tiles: int
) -> torch.Tensor | None:
    """Super-block scales with lows of their own (``P = 2``: a Q5_K's or Q2_K's) for 6-bit
    weights packed as ``q + shift`` (``W = (q + shift) d sc + dlow m``, so the kernel's low is
    ``dlow m``), where those lie in 0..63 (``lo``, ``hi``: the least and greatest ``q``;
    :func:`_pack_super_blocks`); else ``None``."""
    if not isinstance(scales, SuperBlockScales) or scales.d.shape[-1] != 2:
        return None
    if not (0 <= lo + scales.shift and hi + scales.shift <= 63):
        return None
    return _pack_super_blocks(scales, scales.shift, 0, tiles)


def _pack_six_bits(q: torch.Tensor, group: int, tiles: int, offset: int = 32) -> torch.Tensor:
    """``q + offset`` (``q [N, K]`` int8, ``q + offset`` in 0..63; ``offset`` 32 unless the
    scales say otherwise, see :func:`_super_blocks_in_six_bits`) in the kernel's Int6Format,
    groups of ``group`` (16 or 32): ``[N/16, 12 K]`` uint8, see
    :func:`pack_int8_group_weight`."""
    n, k = q.shape
    # q + offset lies in 0..63, so the int8 sum is exact
    u = (q + offset).view(torch.uint8).view(tiles, INT4_TILE, k // group, group)
    u = u.permute(0, 2, 1, 3)  # [tile, group, lane, input]
    # nibble chunks: [.., chunk, half, byte] -> [tile, group, chunk, lane, byte] (a uint8 shift
    # by 4 drops the top bits)
    low = u.reshape(tiles, k // group, INT4_TILE, group // 8, 2, 4)
    nibbles = ((low[..., 0, :] & 0xF) | (low[..., 1, :] << 4)).permute(0, 1, 3, 2, 4)
    # top bit pairs: input 16 h + 4 f + j at bits 2 f of byte j
    top = (u >> 4).reshape(tiles, k // group, INT4_TILE, group // 16, 4, 4)
    top = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    top = top.permute(0, 1, 3, 2, 4)
    return torch.cat((nibbles, top), dim=2).contiguous().view(tiles, k * INT4_TILE * 3 // 4)


def int8_group_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``pyxllm.kernels.native.int8_group_linear``'s weights with int8 activations (W8A8 in groups
    of 32 or 16), the arithmetic of :func:`int4_linear` with signed 8-bit weights: a row's result
    does not depend on the other rows up to 32 rows (at any count with ``batch_invariant``);
    above, the dequantized weights in a BLAS GEMM.

    Args:
        x: ``[..., K]`` float32 or bfloat16; packed, scales_and_zeros: from
            :func:`pack_int8_group_weight`, packed from pairs in ``x.dtype``; group_size: 32 or
            16 (the groups of ``scales_and_zeros``); bias: ``[N]`` or None; batch_invariant: as
            :func:`int4_linear`'s.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    Raises:
        RuntimeError: a shape, dtype or group size the kernel does not take.
    """
    return torch.ops.pyxllm_cpu.int8_group_linear.default(
        x, packed, scales_and_zeros, group_size, bias, batch_invariant
    )
