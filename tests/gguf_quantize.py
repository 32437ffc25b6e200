"""Test helper: quantize float32 rows to GGUF's stored block bytes.

gguf-py (``gguf.quants.quantize``) encodes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (Q8_0 as
llama.cpp rounds it) but not the K-quants or the IQ types; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL and IQ4_XS are encoded here with a plain min/max (abs-max for Q3_K, Q6_K and the IQ
types) rule per sub-block and no rounding search, so the bytes are valid blocks (layouts in
``pyxllm.weights.gguf_blocks``) but not the ones llama.cpp would write.

``ERROR_BOUND[type]``: what the tests check, ``|dequantize(quantize_rows(x)) - x| <=
ERROR_BOUND * max |x|`` over each block of ``GGML_QUANT_SIZES[type][0]`` values (32, or 256
for the K-quants). gguf-py's Q4_0 and Q5_0 clip the value opposite the largest (``d = max /
-8``), hence a full step for them.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

_T = GGMLQuantizationType
ERROR_BOUND = {
    # half a step (d = range / levels, range <= 2 max|x|), or a full one where gguf-py clips;
    # 2^-8 (2^-10) covers rounding d and m to float16
    _T.Q4_0: 1 / 8 + 2**-8,
    _T.Q4_1: 1 / 15 + 2**-8,
    _T.Q5_0: 1 / 16 + 2**-8,
    _T.Q5_1: 1 / 31 + 2**-8,
    _T.Q8_0: 1 / 254 + 2**-10,
    # half a step <= ((2 max|x| + dmin) / levels + d) / 2, dmin <= max|x| / 63, d <= step / 63
    _T.Q4_K: 1 / 15 + 2**-8,
    _T.Q5_K: 1 / 31 + 2**-8,
    # half a step <= (max|x| / 31 + d) / 2, d <= max|x| / (31 * 127)
    _T.Q6_K: 1 / 62 + 2**-10,
    # Q4_K's rule with 3 levels and 4-bit scales and mins: a step <= (2 + 1/15) max|x| / 3 + d
    _T.Q2_K: 1 / 3 + 1 / 45 + 2**-5,
    # half a step <= (max|x| / 3 + d) / 2, d <= max|x| / (3 * 31)
    _T.Q3_K: 1 / 6 + 1 / 186 + 2**-8,
    # the widest gap between the 16 values is 24 (89 -> 113), the top clips 127 to 113: 14 of
    # the 127 steps of max|x| / 127 (IQ4_XS: the scale rounded up by at most 1/31)
    _T.IQ4_NL: 14 / 127 + 2**-8,
    _T.IQ4_XS: 14 / 127 * (1 + 1 / 31) + 2**-8,
}


def quantize_rows(weights: np.ndarray, ggml_type) -> np.ndarray:
    """``weights`` float32 ``[rows, K]`` -> uint8 ``[rows, row_bytes]`` of ``ggml_type`` blocks."""
    ggml_type = GGMLQuantizationType(ggml_type)
    weights = np.asarray(weights, dtype=np.float32)
    rows, k = weights.shape
    if ggml_type in (_T.Q4_K, _T.Q5_K):
        blocks = _q45_k(weights.reshape(-1, 8, 32), 15 if ggml_type == _T.Q4_K else 31)
    elif ggml_type == _T.Q6_K:
        blocks = _q6_k(weights.reshape(-1, 16, 16))
    elif ggml_type == _T.Q2_K:
        blocks = _q2_k(weights.reshape(-1, 16, 16))
    elif ggml_type == _T.Q3_K:
        blocks = _q3_k(weights.reshape(-1, 16, 16))
    elif ggml_type == _T.IQ4_NL:
        blocks = _iq4(weights.reshape(-1, 1, 32))
    elif ggml_type == _T.IQ4_XS:
        blocks = _iq4(weights.reshape(-1, 8, 32))
    else:
        return quantize(weights, ggml_type)
    assert blocks.shape[-1] == GGML_QUANT_SIZES[ggml_type][1]
    return blocks.reshape(rows, -1)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= ``x`` (float32, >= 0), so a scale rounded to it never clips."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _ceil_div(num: np.ndarray, den: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, np.ceil(num / den), 0)
    return np.clip(out, 0, top).astype(np.uint8)


def _q45_k(x: np.ndarray, levels: int) -> np.ndarray:
    """``x`` ``[n, 8, 32]`` -> Q4_K (levels 15) or Q5_K (31) blocks: sub-block ``s`` covers
    ``[-dmin m_s, -dmin m_s + levels d sc_s]``, rounded outward so it holds the sub-block's
    min (or 0) and max."""
    n = x.shape[0]
    low = np.minimum(x.min(axis=-1), 0)  # [n, 8]; the offset -dmin*m is <= 0
    high = x.max(axis=-1)
    dmin = _f16_up(-low.min(axis=-1) / 63)  # [n]
    m = _ceil_div(-low, dmin.astype(np.float32)[:, None], 63)
    offset = dmin.astype(np.float32)[:, None] * m
    need = (high + offset) / levels
    d = _f16_up(need.max(axis=-1) / 63)
    sc = _ceil_div(need, d.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)  # [n, 8, 32]
    # 12 scale bytes: sc/m 0..3 in bytes 0..7 (low 6 bits), 4..7 split over bytes 8..11 and
    # the top 2 bits of bytes 0..7
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(n, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if levels == 31:
        bits = (q >> 4).transpose(0, 2, 1)  # [n, 32 lanes, 8 sub-blocks]
        parts.append(np.packbits(bits, axis=-1, bitorder="little").reshape(n, 32))
    return np.concatenate([*parts, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 16, 16]`` -> Q6_K blocks, symmetric: ``q`` in -31..31, stored ``q + 32``."""
    n = x.shape[0]
    need = np.abs(x).max(axis=-1) / 31  # [n, 16]
    d = _f16_up(need.max(axis=-1) / 127)
    sc = _ceil_div(need, d.astype(np.float32)[:, None], 127)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # half, quarter, lane
    low = (q & 15).reshape(n, 2, 2, 64)  # quarters 2s, 2s+1 -> nibble s of ql[64 h + ...]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    top = (q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = np.bitwise_or.reduce(top, axis=2).reshape(n, 64)
    return np.concatenate(
        [ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=-1
    )


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """``q`` ``[n, 256]`` values 0..3 -> Q2_K / Q3_K ``qs[64]``: element ``128 h + 32 c + l`` at
    bits ``2c`` of byte ``32 h + l``."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 16, 16]`` -> Q2_K blocks by Q4_K's outward rule with 3 levels, 4-bit scales
    and mins."""
    n = x.shape[0]
    low = np.minimum(x.min(axis=-1), 0)
    dmin = _f16_up(-low.min(axis=-1) / 15)
    m = _ceil_div(-low, dmin.astype(np.float32)[:, None], 15)
    offset = dmin.astype(np.float32)[:, None] * m
    need = (x.max(axis=-1) + offset) / 3
    d = _f16_up(need.max(axis=-1) / 15)
    sc = _ceil_div(need, d.astype(np.float32)[:, None], 15)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 3).reshape(n, 256)
    parts = [sc | (m << 4), _two_bit_bytes(q)]
    parts += [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)]
    return np.concatenate(parts, axis=-1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, 16, 16]`` -> Q3_K blocks, symmetric: ``q`` in -3..3 (of -4..3), a step of
    ``d (sc - 32)`` with ``sc - 32`` in 0..31."""
    n = x.shape[0]
    need = np.abs(x).max(axis=-1) / 3
    d = _f16_up(need.max(axis=-1) / 31)
    sc = _ceil_div(need, d.astype(np.float32)[:, None], 31)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(n, 256)  # 0..7; bit 2 set: q >= 0
    hmask = np.packbits((q >> 2).reshape(n, 8, 32).transpose(0, 2, 1), axis=-1, bitorder="little")
    stored = sc + 32  # 6 bits: low 4 in nibble s // 8 of byte s % 8, high 2 in bytes 8..11
    low = stored & 15
    top = (stored >> 4).reshape(n, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    scales = [low[:, :8] | (low[:, 8:] << 4), np.bitwise_or.reduce(top, axis=1)]
    parts = [hmask.reshape(n, 32), _two_bit_bytes(q & 3), *scales]
    return np.concatenate([*parts, d.view(np.uint8).reshape(n, 2)], axis=-1)


def _iq4(x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, s, 32]`` -> IQ4_NL blocks (``s`` 1) or IQ4_XS super-blocks (``s`` 8): each
    value the nearest of the 16 ``IQ4_VALUES`` times the sub-block's step ``max|x| / 127``
    (IQ4_XS: ``d (ls - 32)``, rounded up)."""
    from pyxllm.weights.gguf_blocks import IQ4_VALUES

    n, subs = x.shape[:2]
    need = np.abs(x).max(axis=-1) / 127  # [n, s]
    if subs == 1:
        d = _f16_up(need[:, 0])
        step = d.astype(np.float32)[:, None]
    else:
        d = _f16_up(need.max(axis=-1) / 31)
        ls = _ceil_div(need, d.astype(np.float32)[:, None], 31) + 32
        step = d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(step[..., None] > 0, x / step[..., None], 0)
    index = np.abs(v[..., None] - IQ4_VALUES.astype(np.float32)).argmin(axis=-1).astype(np.uint8)
    qs = (index[..., :16] | (index[..., 16:] << 4)).reshape(n, subs * 16)
    if subs == 1:
        return np.concatenate([d.view(np.uint8).reshape(n, 2), qs], axis=-1)
    low = (ls & 15).reshape(n, 4, 2)
    high = (ls.astype(np.uint16) >> 4) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = np.bitwise_or.reduce(high, axis=-1).astype("<u2").view(np.uint8).reshape(n, 2)
    parts = [d.view(np.uint8).reshape(n, 2), scales_h, low[..., 0] | (low[..., 1] << 4), qs]
    return np.concatenate(parts, axis=-1)
