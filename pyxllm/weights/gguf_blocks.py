"""Exact decoders from GGUF's stored quantization blocks to the CPU kernels' grouped formats.

Two target formats (see ``pyxllm.kernels.native.quantized``), both groups of input features
with a float32 scale and zero per (row, group):

- int4: ``W[r, k] = (q[r, k] - 8) * scale[r, k // 32] + zero[r, k // 32]``, ``q`` uint8 0..15.
- int8: ``W[r, k] = q[r, k] * scale[r, k // G] + zero[r, k // G]``, ``q`` int8, ``G`` 32 or 16.

Block layouts, little-endian, from llama.cpp's ``ggml/src/ggml-common.h`` (``block_q4_0`` ...
``block_q6_K``) and gguf-py's ``gguf/quants.py``; ``d``, ``m``, ``dmin`` are float16. A
32-value block stores element ``j < 16`` in the low nibble of ``qs[j]`` and ``j + 16`` in its
high nibble; a 256-value K-quant super-block stores sub-blocks ``2i`` and ``2i + 1`` in the low
and high nibbles of ``qs[32 i : 32 i + 32]``.

====== ===== ====================================================== =======================
type   bytes fields                                                 value
====== ===== ====================================================== =======================
Q4_0   18    d, qs[16]                                              d * (q - 8)
Q4_1   20    d, m, qs[16]                                           d * q + m
Q5_0   22    d, qh u32 (bit j: bit 4 of element j), qs[16]          d * (q - 16)
Q5_1   24    d, m, qh u32, qs[16]                                   d * q + m
Q8_0   34    d, qs int8[32]                                         d * q
Q4_K   144   d, dmin, scales[12], qs[128]                           d*sc[s] * q - dmin*m[s]
Q5_K   176   d, dmin, scales[12], qh[32] (bit s of qh[l]: bit 4 of  d*sc[s] * q - dmin*m[s]
             element l of sub-block s), qs[128]
Q6_K   210   ql[128], qh[64], scales int8[16], d                    d * sc[k // 16] * (q-32)
Q2_K   84    scales[16] (sc | m << 4), qs[64], d, dmin              d*sc[s] * q - dmin*m[s]
Q3_K   110   hmask[32], qs[64], scales[12], d                       d * (sc[s] - 32) * q
IQ4_NL 18    d, qs[16]                                              d * KVALUES[q]
IQ4_XS 136   d, scales_h u16, scales_l[4], qs[128]                  d * (ls[s] - 32) * KV[q]
====== ===== ====================================================== =======================

K-quant 6-bit scales (``sc``) and mins (``m``) of sub-block ``s`` (8 per super-block): for
``s < 4``, ``scales[s] & 63`` and ``scales[s + 4] & 63``; for ``s >= 4``,
``scales[s + 4] & 15 | scales[s - 4] >> 6 << 4`` and ``scales[s + 4] >> 4 | scales[s] >> 6 << 4``.
Q6_K: of half ``h`` (128 values), quarter ``c`` (32), lane ``l``: the low 4 bits are nibble
``c // 2`` of ``ql[64 h + 32 (c % 2) + l]``, the high 2 bits are bits ``2c, 2c + 1`` of
``qh[32 h + l]``. Q2_K and Q3_K (sub-blocks of 16): element ``128 h + 32 c + l`` has its 2 low
bits at bits ``2c`` of ``qs[32 h + l]``; Q3_K's third bit is bit ``j`` of ``hmask[l]`` for
element ``32 j + l``, and ``q`` is those 3 bits minus 4 where that bit is 0 (-4..3, else 0..3);
its 6-bit scale ``s`` has the low 4 bits in nibble ``s // 8`` of byte ``s % 8`` and the high 2
bits at bits ``2 (s // 4)`` of byte ``8 + s % 4``. IQ4_NL and IQ4_XS look each 4-bit index up in
llama.cpp's ``kvalues_iq4nl`` (:data:`IQ4_VALUES`, int8), nibbles as Q4_0's; IQ4_XS's 6-bit
scale of sub-block ``s`` (of 32) is nibble ``s % 2`` of ``scales_l[s // 2]`` with bits ``2s,
2s + 1`` of ``scales_h`` on top.

Precision, against ``gguf.quants.dequantize`` of the same bytes: every product here
(``d * sc``, ``(q - 8) * scale``, ``dmin * m``) is exact in float32, so where the zero is 0
(Q4_0, Q5_0, Q8_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS) or a product (Q2_K's ``-dmin m``), the
kernels' formula rounds once where gguf-py does and gives its float32 values exactly (up to the
sign of a zero). Where it is a sum (Q4_1, Q5_1, Q4_K, Q5_K), ``zero`` is one float32 sum, and
the formula's final add rounds once, like gguf-py's: the results agree exactly whenever that
sum is exact (the usual case: ``d`` and ``m`` within about 2^7 of each other), and otherwise
within one rounding of ``zero``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType
INT4_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q4_K)
INT8_TYPES = (_T.Q8_0, _T.Q5_0, _T.Q5_1, _T.Q5_K, _T.Q6_K, _T.Q2_K, _T.Q3_K, _T.IQ4_NL, _T.IQ4_XS)
# the types held in groups of 16 input features (their sub-blocks), the others in groups of 32
GROUPS_OF_16 = (_T.Q6_K, _T.Q2_K, _T.Q3_K)
# llama.cpp's kvalues_iq4nl: the values IQ4_NL's and IQ4_XS's 4-bit indices stand for
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)


def int4_groups(raw: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode Q4_0 / Q4_1 / Q4_K rows to the int4 format, groups of 32.

    Args:
        raw: uint8 ``[rows, row_bytes]``, whole rows as the GGUF file stores them (any strides).
        ggml_type: a type in ``INT4_TYPES``.
    Returns:
        ``(q, scale, zero)``: ``q`` uint8 ``[rows, K]`` in 0..15, ``scale`` and ``zero``
        float32 ``[rows, K // 32]``, with ``W = (q - 8) * scale + zero``. Q4_0: ``scale = d``,
        ``zero = 0``; Q4_1: ``scale = d``, ``zero = m + 8 d``; Q4_K: ``scale = d * sc``,
        ``zero = 8 d sc - dmin m``.
    Raises:
        ValueError: another type, or ``raw`` not uint8 whole rows of it.
    """
    ggml_type, blocks = _blocks(raw, ggml_type, INT4_TYPES, "int4")
    rows = blocks.shape[0]
    if ggml_type == _T.Q4_K:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = _k_scales_mins(blocks[..., 4:16])
        q = _k_nibbles(blocks[..., 16:144])
        scale = d[..., None] * sc.astype(np.float32)
        zero = np.float32(8) * scale - dmin[..., None] * m.astype(np.float32)
    else:
        offset = 2 if ggml_type == _T.Q4_0 else 4
        q = _nibbles(blocks[..., offset : offset + 16])
        scale = _f16(blocks, 0)[..., None]
        if ggml_type == _T.Q4_0:
            zero = np.zeros_like(scale)
        else:
            zero = _f16(blocks, 2)[..., None] + np.float32(8) * scale
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def int8_groups(raw: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Decode Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K / Q2_K / Q3_K / IQ4_NL / IQ4_XS rows to the int8
    format.

    Args:
        raw: uint8 ``[rows, row_bytes]``, whole rows as the GGUF file stores them (any strides).
        ggml_type: a type in ``INT8_TYPES``.
    Returns:
        ``(q, scale, zero, group_size)``: ``q`` int8 ``[rows, K]``, ``scale`` and ``zero``
        float32 ``[rows, K // group_size]``, with ``W = q * scale + zero``. ``group_size`` is
        16 for Q6_K (``q`` = stored - 32, ``scale = d * sc``, ``zero = 0``), Q2_K (``q`` 0..3,
        ``scale = d * sc``, ``zero = -dmin m``) and Q3_K (``q`` -4..3, ``scale = d (sc -
        32)``), else 32: Q8_0 ``scale = d``; Q5_0 ``q`` = stored - 16, ``scale = d``; Q5_1
        ``q`` = stored - 16, ``scale = d``, ``zero = m + 16 d``; Q5_K ``q`` = stored - 16,
        ``scale = d * sc``, ``zero = 16 d sc - dmin m``; IQ4_NL ``q = IQ4_VALUES[index]``,
        ``scale = d``; IQ4_XS ``q`` likewise, ``scale = d (ls - 32)``; the others' zero is 0.
    Raises:
        ValueError: another type, or ``raw`` not uint8 whole rows of it.
    """
    ggml_type, blocks = _blocks(raw, ggml_type, INT8_TYPES, "int8")
    rows = blocks.shape[0]
    group_size = 32
    if ggml_type == _T.Q8_0:
        q = blocks[..., 2:].view(np.int8)
        scale = _f16(blocks, 0)[..., None]
        zero = np.zeros_like(scale)
    elif ggml_type in (_T.Q5_0, _T.Q5_1):
        offset = 2 if ggml_type == _T.Q5_0 else 4
        high = np.unpackbits(blocks[..., offset : offset + 4], axis=-1, bitorder="little")
        q = _nibbles(blocks[..., offset + 4 : offset + 20]) | (high << 4)
        scale = _f16(blocks, 0)[..., None]
        if ggml_type == _T.Q5_0:
            zero = np.zeros_like(scale)
        else:
            zero = _f16(blocks, 2)[..., None] + np.float32(16) * scale
        q = (q.astype(np.int8) - np.int8(16)).astype(np.int8)
    elif ggml_type == _T.Q5_K:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = _k_scales_mins(blocks[..., 4:16])
        # [rows, n, 32 lanes, 8 bits] -> bit s of lane l is bit 4 of sub-block s's element l
        high = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")
        high = high.swapaxes(-1, -2).reshape(*blocks.shape[:2], 256)
        q = _k_nibbles(blocks[..., 48:176]) | (high << 4)
        q = (q.astype(np.int8) - np.int8(16)).astype(np.int8)
        scale = d[..., None] * sc.astype(np.float32)
        zero = np.float32(16) * scale - dmin[..., None] * m.astype(np.float32)
    elif ggml_type == _T.Q2_K:
        group_size, n = 16, blocks.shape[:2]
        q = _two_bits(blocks[..., 16:80]).astype(np.int8)
        d, dmin = _f16(blocks, 80)[..., None], _f16(blocks, 82)[..., None]
        scale = d * (blocks[..., :16] & 15).astype(np.float32)
        zero = -(dmin * (blocks[..., :16] >> 4).astype(np.float32))
    elif ggml_type == _T.Q3_K:
        group_size, n = 16, blocks.shape[:2]
        # bit j of hmask[l] for element 32 j + l
        high = np.unpackbits(blocks[..., :32, None], axis=-1, bitorder="little")
        high = high.swapaxes(-1, -2).reshape(*n, 256)
        q = (_two_bits(blocks[..., 32:96]) | (high << 2)).astype(np.int8) - np.int8(4)
        scale = _f16(blocks, 108)[..., None] * _q3_k_scales(blocks).astype(np.float32)
        zero = np.zeros_like(scale)
    elif ggml_type == _T.IQ4_NL:
        q = IQ4_VALUES[_nibbles(blocks[..., 2:18])]
        scale = _f16(blocks, 0)[..., None]
        zero = np.zeros_like(scale)
    elif ggml_type == _T.IQ4_XS:
        n = blocks.shape[:2]
        q = IQ4_VALUES[_nibbles(blocks[..., 8:136].reshape(*n, 8, 16))].reshape(*n, 256)
        scale = _f16(blocks, 0)[..., None] * _iq4_xs_scales(blocks).astype(np.float32)
        zero = np.zeros_like(scale)
    else:  # Q6_K
        group_size = 16
        n = blocks.shape[:2]
        # [rows, n, half, quarter, 32]: quarter c holds the low (c < 2) or high nibbles of
        # ql[64 h + 32 (c % 2) + l], under bits 2c of qh[32 h + l]; built in place, 6 passes
        # over the weights where temporaries took ~3x the time
        q = np.empty((*n, 2, 4, 32), np.uint8)
        low = blocks[..., :128].reshape(*n, 2, 2, 32)
        np.bitwise_and(low, 15, out=q[..., 0:2, :])
        np.right_shift(low, 4, out=q[..., 2:4, :])
        high = (
            blocks[..., 128:192].reshape(*n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        )
        high &= 3
        high <<= 4
        q |= high
        q -= np.uint8(32)  # stored - 32, wrapping to the int8 bits
        q = q.view(np.int8)
        scale = _f16(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
        zero = np.zeros_like(scale)
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1), group_size


def super_block_shift(ggml_type) -> int:
    """The ``shift`` of :func:`super_block_scales`' formula: 16 for Q5_K (its decoded ``q`` is
    the stored value minus 16), else 0."""
    return 16 if GGMLQuantizationType(ggml_type) == _T.Q5_K else 0


def super_block_scales(raw: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray] | None:
    """The scales of :func:`int4_groups` / :func:`int8_groups` as the file factors them:
    ``W = (q + shift) d sc + dlow m`` (``q`` the decoder's: int4's 0..15, int8's signed;
    ``shift`` :func:`super_block_shift`'s), one rounding at most, as the decoders' (see
    ``pyxllm.kernels.native.quantized.SuperBlockScales``).

    Args:
        raw: as :func:`int4_groups`' (``ggml_type`` any GGML type).
    Returns:
        ``(d, sub)``: ``d`` float32 ``[rows, K/256, P]`` (float16 values), ``sub`` int8
        ``[rows, K/G, P]`` (G the decoder's group size): Q4_K, Q5_K and Q2_K ``(d, -dmin)`` and
        ``(sc, m)``, ``P = 2``; Q6_K ``d`` and its int8 scales, Q3_K ``d`` and ``sc - 32``,
        IQ4_XS ``d`` and ``ls - 32``, ``P = 1``. ``None`` for the 32-value types (no
        super-block).
    Raises:
        ValueError: ``raw`` not uint8 whole rows of its type.
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in (_T.Q4_K, _T.Q5_K, _T.Q2_K, _T.Q6_K, _T.Q3_K, _T.IQ4_XS):
        return None
    ggml_type, blocks = _blocks(raw, ggml_type, (ggml_type,), "super-block")
    rows = blocks.shape[0]
    if ggml_type in (_T.Q4_K, _T.Q5_K):
        d = np.stack((_f16(blocks, 0), -_f16(blocks, 2)), axis=-1)
        sub = np.stack(_k_scales_mins(blocks[..., 4:16]), axis=-1)
    elif ggml_type == _T.Q2_K:
        d = np.stack((_f16(blocks, 80), -_f16(blocks, 82)), axis=-1)
        sub = np.stack((blocks[..., :16] & 15, blocks[..., :16] >> 4), axis=-1)
    elif ggml_type == _T.Q6_K:
        d, sub = _f16(blocks, 208)[..., None], blocks[..., 192:208].view(np.int8)[..., None]
    elif ggml_type == _T.Q3_K:
        d, sub = _f16(blocks, 108)[..., None], _q3_k_scales(blocks)[..., None]
    else:  # IQ4_XS
        d, sub = _f16(blocks, 0)[..., None], _iq4_xs_scales(blocks)[..., None]
    return d, sub.astype(np.int8).reshape(rows, -1, sub.shape[-1])


def _blocks(raw: np.ndarray, ggml_type, supported: tuple, kind: str):
    """``raw`` as contiguous uint8 ``[rows, blocks per row, type_size]``."""
    try:
        ggml_type = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ValueError(f"ggml type {ggml_type!r} is not a GGML quantization type") from None
    if ggml_type not in supported:
        names = ", ".join(t.name for t in supported)
        raise ValueError(
            f"{ggml_type.name} weights cannot be decoded to the {kind} format; it takes {names}"
        )
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % type_size:
        raise ValueError(
            f"expected uint8 [rows, row_bytes] with row_bytes a multiple of {type_size} "
            f"({ggml_type.name}'s block size in bytes), got {raw.dtype} {list(raw.shape)}"
        )
    raw = np.ascontiguousarray(raw)
    return ggml_type, raw.reshape(raw.shape[0], -1, type_size)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of each block, as float32 ``[rows, n]``."""
    half = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)
    return half[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` values: low nibbles first, then high nibbles
    (written in place: ~1.4x faster than concatenating the two halves, most of a Q4_0 file's
    load)."""
    out = np.empty((*qs.shape[:-1], 32), np.uint8)
    np.bitwise_and(qs, 15, out=out[..., :16])
    np.right_shift(qs, 4, out=out[..., 16:])
    return out


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K ``qs[64]`` -> ``[..., 256]`` values 0..3: half ``h``'s quarter ``c`` is bits
    ``2c`` of ``qs[32 h : 32 h + 32]``."""
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant ``qs[128]`` -> ``[..., 256]``: chunk ``i``'s low then high nibbles."""
    out = np.empty((*qs.shape[:-1], 4, 2, 32), np.uint8)
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    np.bitwise_and(chunks, 15, out=out[..., 0, :])
    np.right_shift(chunks, 4, out=out[..., 1, :])
    return out.reshape(*qs.shape[:-1], 256)


def _q3_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q3_K's 16 sub-block scales ``sc - 32``, int8 ``[..., 16]`` in -32..31."""
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-1)
    top = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    sc = low | (top.reshape(*blocks.shape[:-1], 16) << 4)
    return (sc.astype(np.int8) - np.int8(32)).astype(np.int8)


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS's 8 sub-block scales ``ls - 32``, int8 ``[..., 8]`` in -32..31."""
    n = blocks.shape[:-1]
    low = blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)
    high = np.unpackbits(blocks[..., 2:4, None], axis=-1, bitorder="little").reshape(*n, 8, 2)
    ls = (low.reshape(*n, 8) & 15) | (high[..., 0] << 4) | (high[..., 1] << 5)
    return (ls.astype(np.int8) - np.int8(32)).astype(np.int8)


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes -> (sc, m), uint8 ``[..., 8]`` each, 6 bits."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m
