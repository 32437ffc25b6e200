"""Test helper: quantize float32 rows to GGUF's stored block bytes.

gguf-py (``gguf.quants.quantize``) encodes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (Q8_0 as
llama.cpp rounds it) but not the K-quants; Q4_K, Q5_K and Q6_K are encoded here with a plain
min/max (abs-max for Q6_K) rule per sub-block and no rounding search, so the bytes are valid
blocks (layouts in ``pyxllm.weights.gguf_blocks``) but not the ones llama.cpp would write.

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
