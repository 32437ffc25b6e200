"""Layers against transformers' own formulas: RoPE frequencies (plain, linear, llama3, Phi-3's
longrope with short and long factors), partial rotary, RMSNorm."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from pyxllm.kernels import native
from pyxllm.layers.layernorm import RMSNorm
from pyxllm.layers.rotary_embedding import RotaryEmbedding
from pyxllm.models.config_utils import rope_parameters
from pyxllm.models.phi3 import phi3_rotary_embedding

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(**kwargs) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512, **kwargs
    )


def _reference_inv_freq(config) -> torch.Tensor:
    base, scaling = rope_parameters(config)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert factor == 1.0
    return inv_freq


@pytest.mark.parametrize(
    "config",
    [
        _config(),
        _config(rope_scaling={"type": "linear", "factor": 2.0}),
        _config(rope_parameters=LLAMA3),
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_cache_matches_transformers_frequencies(config):
    base, scaling = rope_parameters(config)
    rope = RotaryEmbedding(64, 512, base, scaling)
    freqs = torch.outer(torch.arange(512).float(), _reference_inv_freq(config))
    expected = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=1e-6)


def test_rope_rotates_like_transformers():
    config = _config(rope_parameters=LLAMA3)
    base, scaling = rope_parameters(config)
    rope = RotaryEmbedding(64, 512, base, scaling)
    positions = torch.tensor([0, 3, 77, 400])
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    q_out, k_out = rope(positions, q, k)
    freqs = torch.outer(positions.float(), _reference_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    rotate = lambda x: torch.cat((-x[..., 32:], x[..., :32]), dim=-1)  # noqa: E731
    torch.testing.assert_close(q_out, q * cos + rotate(q) * sin)
    torch.testing.assert_close(k_out, k * cos + rotate(k) * sin)
    assert not torch.allclose(q_out[1:], q[1:])


def _phi3(**kwargs) -> Phi3Config:
    """Head dim 32, rotary width 24 (factor 0.75): 12 short and 12 long factors."""
    return Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [2.0 + 3.0 * i for i in range(12)],
        },
        **kwargs,
    )


@pytest.mark.parametrize("max_model_len, long", [(64, False), (65, True), (512, True)])
def test_longrope_cache_matches_transformers(max_model_len, long):
    """Short factors up to original_max_position_embeddings (64), long ones past it, chosen by
    the context served; cos and sin carry transformers' attention factor."""
    from pyxllm.models.build_context import model_build_context

    config = _phi3()
    with model_build_context(max_model_len):
        rope = phi3_rotary_embedding(config)
    seq_len = 65 if long else None  # transformers takes the long factors past 64 positions
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    assert attention_factor == pytest.approx((1 + math.log(8) / math.log(64)) ** 0.5)
    freqs = torch.outer(torch.arange(max_model_len).float(), inv_freq)
    expected = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    assert rope.cos_sin_cache.shape == (max_model_len, 24)
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=1e-6)


def test_partial_rotary_turns_only_the_first_channels_like_transformers():
    config = _phi3()
    rope = phi3_rotary_embedding(config)
    positions = torch.tensor([0, 5, 63, 200])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    q_out, k_out = rope(positions, q, k)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=512)
    emb = torch.outer(positions.float(), inv_freq).repeat(1, 2)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)
    assert torch.equal(q_out[..., 24:], q[..., 24:]) and not torch.allclose(q_out[1:], q[1:])


def test_longrope_factors_of_the_wrong_length_are_refused():
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 12,
        "long_factor": [1.0] * 12,
        "original_max_position_embeddings": 64,
        "factor": 8.0,
    }
    with pytest.raises(ValueError, match="short_factor has 12 entries; the rotary width 32"):
        RotaryEmbedding(32, 64, 10000.0, scaling)  # all 32 channels turn: 16 factors needed


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_unsupported_rope_scaling_is_refused_by_name(kind):
    with pytest.raises(ValueError, match=kind):
        RotaryEmbedding(64, 512, 10000.0, {"rope_type": kind, "factor": 2.0})


def test_rms_norm_equals_transformers_and_fuses_the_residual():
    """The native kernel is transformers' arithmetic exactly; the platform's kernel (the fused
    C++ one on CPU) may sum the squares in another order, a few float32 ulp apart."""
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    ours, theirs = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
        assert torch.equal(native.rms_norm(x, ours.weight, 1e-5), theirs(x))
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        torch.testing.assert_close(normed, theirs(x + residual), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_encoder_attention_is_each_sequences_own_softmax(dtype, atol):
    """Encoder attention pads sequences to a multiple of 16 and runs each padded length in one
    call: every sequence still gets softmax(q k^T * scale) v over its own tokens only, and the
    same bits alone as beside neighbours."""
    import torch.nn.functional as F

    from pyxllm.attention.encoder import EncoderAttentionStep

    torch.manual_seed(0)
    lens = [5, 16, 17, 3, 40, 12]
    q, k, v = (torch.randn(sum(lens), 4, 8, dtype=dtype) for _ in range(3))
    out = EncoderAttentionStep(lens).forward(q, k, v, None, None, 0.3)
    start = 0
    for length in lens:
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].transpose(0, 1).double() for t in (q, k, v))
        want = F.softmax(qs @ ks.transpose(1, 2) * 0.3, dim=-1) @ vs
        torch.testing.assert_close(out[rows].double(), want.transpose(0, 1), atol=atol, rtol=0)
        alone = EncoderAttentionStep([length]).forward(q[rows], k[rows], v[rows], None, None, 0.3)
        assert torch.equal(alone, out[rows])
        start += length
