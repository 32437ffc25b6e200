"""pyxllm.weights.gguf_blocks against gguf-py's dequantize, on blocks from tests/gguf_quantize.py
(whose own round trip is checked first) and on random block bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pyxllm.weights.gguf_blocks import (
    GROUPS_OF_16,
    INT4_TYPES,
    INT8_TYPES,
    int4_groups,
    int8_groups,
)
from pyxllm.weights.gguf_reader import open_gguf
from tests.gguf_quantize import ERROR_BOUND, quantize_rows

T = GGMLQuantizationType
TYPES = INT4_TYPES + INT8_TYPES
# types whose zero is 0: the kernels' formula is gguf-py's float32 product, exactly
ZERO_FREE = (T.Q4_0, T.Q8_0, T.Q5_0, T.Q6_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS)
# ... and those whose zero is an exact product, added once as gguf-py adds it
EXACT = (*ZERO_FREE, T.Q2_K)
# the int8 q's range of each type (default: the 5-bit types' -16..15)
Q_RANGE = {
    T.Q8_0: (-128, 127),
    T.Q6_K: (-32, 31),
    T.Q2_K: (0, 3),
    T.Q3_K: (-4, 3),
    T.IQ4_NL: (-127, 113),
    T.IQ4_XS: (-127, 113),
}
# byte offsets of each block's float16 fields (d, m / dmin)
HALF_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
SEEDS = (0, 1, 2)


def make_weights(seed: int, rows: int = 6, k: int = 512) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    w[1] = 0.7  # constant
    w[2] = 0.0
    w[3] = np.abs(w[3]) + 2  # all positive, away from 0
    w[4] *= np.float32(10.0) ** rng.uniform(-3, 1, size=k // 32).repeat(32)  # scales per group
    w[5] = -np.abs(w[5]) - 1  # all negative
    return w


def decode(raw: np.ndarray, ggml_type) -> tuple[np.ndarray, ...]:
    """(W float32 by the kernels' formula, q, scale, zero, group_size)."""
    if ggml_type in INT4_TYPES:
        q, scale, zero = int4_groups(raw, ggml_type)
        group, values = 32, q.astype(np.float32) - np.float32(8)
    else:
        q, scale, zero, group = int8_groups(raw, ggml_type)
        values = q.astype(np.float32)
    w = values * scale.repeat(group, axis=1) + zero.repeat(group, axis=1)
    return w, q, scale, zero, group


def exact_zero(raw: np.ndarray, ggml_type, zero: np.ndarray) -> np.ndarray:
    """Where ``zero`` (float32) is the exact sum it stands for, computed in float64 from the
    block's fields (float16 d, m / dmin and the 6-bit scales, all exact in float64)."""
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)
    d, m = (
        blocks[..., i : i + 2].copy().view(np.float16)[..., 0].astype(np.float64) for i in (0, 2)
    )
    if ggml_type in (T.Q4_1, T.Q5_1):
        bias = 8 if ggml_type == T.Q4_1 else 16
        exact = m + bias * d
    else:
        bias = 8 if ggml_type == T.Q4_K else 16
        a, b, c = (blocks[..., i : i + 4].astype(np.int64) for i in (4, 8, 12))
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
        mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
        exact = bias * d[..., None] * sc - m[..., None] * mins
    return zero.astype(np.float64) == exact.reshape(zero.shape)


def check_against_gguf(raw: np.ndarray, ggml_type) -> float:
    """The precision contract; returns the fraction of values equal to gguf-py's."""
    ref = dequantize(np.ascontiguousarray(raw), ggml_type).reshape(raw.shape[0], -1)
    w, q, scale, zero, group = decode(raw, ggml_type)
    rows, k = ref.shape
    assert group == (16 if ggml_type in GROUPS_OF_16 else 32)
    assert q.shape == (rows, k) and scale.shape == zero.shape == (rows, k // group)
    assert scale.dtype == zero.dtype == np.float32
    if ggml_type in INT4_TYPES:
        assert q.dtype == np.uint8 and q.max() <= 15
    else:
        assert q.dtype == np.int8
        low, high = Q_RANGE.get(ggml_type, (-16, 15))
        assert low <= q.min() and q.max() <= high
    if ggml_type in EXACT:
        assert ggml_type not in ZERO_FREE or not zero.any()
        np.testing.assert_array_equal(w, ref)  # bit for bit, but 0.0 == -0.0
        return 1.0
    # zero rounded once more than gguf-py's sum: within an ulp of the result and of zero
    zeros = zero.repeat(group, axis=1)
    assert np.all(np.abs(w - ref) <= 2.0**-23 * (np.abs(ref) + np.abs(zeros)))
    # ... and exact wherever that sum was
    exact = exact_zero(raw, ggml_type, zero).repeat(group, axis=1)
    np.testing.assert_array_equal(w[exact], ref[exact])
    return float(np.mean(w == ref))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_encoder_round_trip(ggml_type, seed):
    w = make_weights(seed)
    raw = quantize_rows(w, ggml_type)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    assert raw.dtype == np.uint8 and raw.shape == (6, 512 // block * type_size)
    back = dequantize(raw, ggml_type).reshape(w.shape)
    peak = np.abs(w).reshape(6, -1, block).max(axis=-1, keepdims=True)
    err = np.abs(back - w).reshape(6, -1, block)
    assert np.all(err <= ERROR_BOUND[ggml_type] * peak + 1e-7)
    np.testing.assert_array_equal(back[2], 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_decoder_matches_gguf(ggml_type, seed):
    raw = quantize_rows(make_weights(seed), ggml_type)
    check_against_gguf(raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_decoder_on_random_blocks(ggml_type):
    """Every bit pattern of the quants and scales, float16 fields over 4 decades."""
    rng = np.random.default_rng(7)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(8, 1024 // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(8, -1, type_size)
    for offset in HALF_FIELDS[ggml_type]:
        half = rng.standard_normal(blocks.shape[:2]) * 10.0 ** rng.uniform(-4, 0, blocks.shape[:2])
        blocks[..., offset : offset + 2] = half.astype(np.float16)[..., None].view(np.uint8)
    check_against_gguf(raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_row_views(ggml_type):
    raw = quantize_rows(make_weights(3), ggml_type)
    whole = decode(raw, ggml_type)
    padded = np.zeros((6, raw.shape[1] + 5), dtype=np.uint8)
    padded[:, 3 : 3 + raw.shape[1]] = raw
    for view, rows in ((raw[1:5], slice(1, 5)), (raw[::2], slice(None, None, 2))):
        for got, want in zip(decode(view, ggml_type)[:4], whole[:4]):
            np.testing.assert_array_equal(got, want[rows])
    unaligned = padded[:, 3 : 3 + raw.shape[1]]
    assert not unaligned.flags.c_contiguous
    for got, want in zip(decode(unaligned, ggml_type)[:4], whole[:4]):
        np.testing.assert_array_equal(got, want)
    check_against_gguf(raw[::2], ggml_type)


def test_unsupported_types():
    raw = np.zeros((2, 144), dtype=np.uint8)
    for decoder, ggml_type in (
        (int4_groups, T.Q8_0),
        (int4_groups, T.Q2_K),
        (int8_groups, T.Q4_K),
        (int8_groups, T.F16),
        (int8_groups, T.IQ3_S),
    ):
        with pytest.raises(ValueError, match=ggml_type.name):
            decoder(raw, ggml_type)
    with pytest.raises(ValueError, match="Q4_K"):
        int4_groups(raw[:, :100], T.Q4_K)  # not whole blocks
    with pytest.raises(ValueError, match="uint8"):
        int4_groups(raw.astype(np.int16), T.Q4_K)


def test_quantized_tensor_in_a_gguf_file(tmp_path):
    """Raw blocks written with GGUFWriter (byte-shaped uint8 + raw_dtype) read back through
    pyxllm's reader, and the decoders take the file's bytes as stored."""
    w = make_weights(4)
    raw = {T.Q4_K: quantize_rows(w, T.Q4_K), T.Q6_K: quantize_rows(w, T.Q6_K)}
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for ggml_type, blocks in raw.items():
        writer.add_tensor(f"{ggml_type.name}.weight", blocks, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = open_gguf(tmp_path / "q.gguf")
    for ggml_type, blocks in raw.items():
        info = f.tensor_by_name[f"{ggml_type.name}.weight"]
        assert info.shape == w.shape and info.ggml_type == ggml_type
        ref = dequantize(blocks, ggml_type)
        np.testing.assert_array_equal(f.read(info), ref)
        stored = np.fromfile(f.path, np.uint8, info.nbytes, offset=info.start).reshape(6, -1)
        np.testing.assert_array_equal(stored, blocks)
        np.testing.assert_array_equal(decode(stored, ggml_type)[0], ref)
