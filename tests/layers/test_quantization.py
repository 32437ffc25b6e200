"""``--quantization`` (weight-only int8/int4, W8A8): formats, the CPU kernels against the reference,
exact recovery of GGUF Q4_1 blocks, and accuracy on the default model against float32 logits.

Accuracy measured here (SmolLM2-135M Q4_1, 4 prompts, 57 positions; logits std ~8, max ~41),
as max |logit diff| / mean |logit diff| / top-1 agreement with float32:
bfloat16 1.36 / 0.16 / 0.95; with the W8A8 LM head every method has: int8 + bf16 3.2 / 0.39 /
0.98; int4 + bf16 2.2 / 0.23 / 0.95; int4 + fp32 activations 2.0 / 0.16 / 0.96 (the head is
then the main loss: with a weight-only int8 head it was 0.68 / 0.06 / 0.93); w8a8 + bf16
2.6 / 0.33 / 0.93 (6.8 / 0.91 / 0.86 without its rotations).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyxllm.config import EngineConfig
from pyxllm.kernels import cpu as cpu_ops
from pyxllm.kernels import native
from pyxllm.kernels.cpu import fused
from pyxllm.kernels.cpu import quantized as aten
from pyxllm.kernels.native.quantized import dequantize_int4
from pyxllm.layers.quantization import quantize_int4_groups, quantize_int8_per_channel

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a forest far away, there lived a",
    "Water boils at 100 degrees Celsius at sea level because",
]


pytestmark = pytest.mark.usefixtures("one_thread")


# --- formats and kernels -------------------------------------------------------------------


def test_int8_per_channel_rounds_each_weight_to_its_row_step():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.rand(48, 1)
    q, scales = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert int(q.abs().max()) == 127
    err = (q.float() * scales.unsqueeze(1) - w).abs()
    assert bool((err <= scales.unsqueeze(1) / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_int8_cpu_kernel_matches_the_reference(dtype, tol):
    torch.manual_seed(0)
    w, x, bias = torch.randn(64, 96), torch.randn(5, 96).to(dtype), torch.randn(64).to(dtype)
    q, scales = quantize_int8_per_channel(w)
    expected = F.linear(x.float(), q.float() * scales.unsqueeze(1)) + bias.float()
    for ops in (native, cpu_ops):
        got = ops.int8_linear(x, q, scales.to(dtype), bias)
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item()
        )


def test_w8a8_error_is_within_the_activation_rounding_bound():
    """Against float activations times the same int8 weights, per-token rounding moves each
    activation by at most half its step ``amax / 127``: ``|diff[m, n]| <= step[m] / 2 *
    sum_k |W[n, k]|`` (plus float32 rounding)."""
    torch.manual_seed(0)
    w, x, bias = (
        torch.randn(64, 96),
        torch.randn(5, 96) * torch.linspace(0.1, 10, 5).unsqueeze(1),
        torch.randn(64),
    )
    q, scales = quantize_int8_per_channel(w)
    weight = q.float() * scales.unsqueeze(1)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    bound = step / 2 * weight.abs().sum(dim=1) + 1e-4
    for ops in (native, cpu_ops):
        diff = (ops.w8a8_linear(x, q, scales, bias) - (F.linear(x, weight) + bias)).abs()
        assert bool((diff <= bound).all()) and diff.max() > 0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_int4_cpu_kernel_computes_q_minus_8_times_scale_plus_zero(dtype, tol):
    """``torch._weight_int4pack_mm_for_cpu`` and the fused W4A8 kernel read groups as
    ``(q - 8) * scale + zero`` (scales_and_zeros ``[K/32, N, 2]``): the layout the GGUF Q4_1
    mapping relies on."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 128), torch.randn(3, 128).to(dtype)
    q, scales_and_zeros = quantize_int4_groups(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scales_and_zeros.shape == (4, 64, 2)
    dequantized = dequantize_int4(q, scales_and_zeros, 32)
    assert (dequantized - w).abs().max() <= scales_and_zeros[..., 0].max() / 2 + 1e-6
    expected = F.linear(x.float(), dequantized)
    kernels = (native, aten, fused) if fused.load() is not None else (native, aten)
    for ops in kernels:  # fused: int8 activations in two parts, ~15 bits (test_cpu_fused_kernels)
        got = ops.int4_linear(x, *ops.pack_int4_weight(q, scales_and_zeros.to(dtype)), 32)
        assert got.dtype == dtype and got.shape == (3, 64)
        torch.testing.assert_close(
            got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item()
        )


def test_int4_pack_refuses_a_row_count_the_cpu_kernels_cannot_tile():
    for pack in (aten.pack_int4_weight, fused.pack_int4_weight):
        with pytest.raises(ValueError, match="multiple of 16"):
            pack(torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(2, 40, 2))


def test_int4_recovers_gguf_q4_1_blocks_exactly(default_gguf_path):
    """Quantizing the dequantized Q4_1 weights gives back the file's q, and d and m as
    ``scale = d``, ``zero = m + 8 d`` (shared PERF_NOTES)."""
    from pyxllm.weights.gguf_reader import open_gguf

    gguf = open_gguf(default_gguf_path)
    info = gguf.tensor_by_name["blk.0.ffn_down.weight"]
    assert info.ggml_type.name == "Q4_1"
    block = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
    raw = np.fromfile(
        default_gguf_path, dtype=block, count=info.nbytes // block.itemsize, offset=info.start
    )
    d = torch.from_numpy(raw["d"].astype(np.float32)).view(info.shape[0], -1)
    m = torch.from_numpy(raw["m"].astype(np.float32)).view(info.shape[0], -1)
    qs = torch.from_numpy(raw["qs"].astype(np.int64))
    file_q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).view(
        info.shape
    )  # low nibbles: 0..15, high: 16..31

    weight = torch.from_numpy(gguf.read(info))
    q, scales_and_zeros = quantize_int4_groups(weight)
    live = (d > 0).repeat_interleave(32, dim=1)
    assert bool(live.float().mean() > 0.99)
    assert torch.equal(q.long()[live], file_q[live])
    torch.testing.assert_close(scales_and_zeros[..., 0].t(), d, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(scales_and_zeros[..., 1].t(), m + 8 * d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        dequantize_int4(q, scales_and_zeros, 32), weight, rtol=1e-5, atol=1e-6
    )


def test_quantization_flag_is_checked():
    assert EngineConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig(quantization="int3")


# --- the default model ---------------------------------------------------------------------


def _logits(llm) -> torch.Tensor:
    """Float32 logits at every position of every prompt, through the executor's real path."""
    from pyxllm.executor.input_batch import InputBatch
    from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
    from pyxllm.sampling_params import SamplingParams

    executor, tokenizer, out = llm.llm_engine.executor.driver, llm.get_tokenizer(), []
    block_size = llm.llm_engine.config.block_size
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        seq = ScheduledSequence(
            request_id="acc",
            token_ids=ids,
            num_computed_tokens=0,
            block_table=list(range(-(-len(ids) // block_size))),
            sample=True,
            sampling_params=SamplingParams(),
        )
        batch = InputBatch.build(SchedulerOutput([seq]), block_size, executor.device)
        with torch.inference_mode():
            hidden = executor.runner.execute(batch, executor.make_context)
            out.append(executor.model.compute_logits(hidden).float())
    return torch.cat(out)


@pytest.fixture(scope="module")
def float32_logits():
    from pyxllm import LLM

    return _logits(LLM(dtype="float32", max_model_len=128, kv_cache_memory=0.05))


@pytest.mark.parametrize(
    "quantization, dtype, max_abs, mean_abs, top1",
    [
        ("int4", "bfloat16", 4.0, 0.5, 0.9),
        ("int8", "bfloat16", 5.0, 0.6, 0.9),
        ("int4", "float32", 3.0, 0.25, 0.85),
        ("w8a8", "bfloat16", 4.0, 0.5, 0.88),
    ],
)
def test_accuracy_against_float32_logits(
    float32_logits, quantization, dtype, max_abs, mean_abs, top1
):
    from pyxllm import LLM

    """The embedded model (Q4_1 decoder layers, a tied Q8_0 embedding) under each method: a
    layer the file stores in the method's own grouped format keeps it (``gguf``: int4 keeps the
    Q4_1 layers, int8 the Q8_0 head); the others are quantized, the LM head by W8A8."""
    llm = LLM(dtype=dtype, quantization=quantization, max_model_len=128, kv_cache_memory=0.05)
    model = llm.llm_engine.executor.driver.model
    layer = model.model.layers[0].mlp.down_proj
    kept = {"int4": ("gguf", "w8a8"), "int8": ("int8", "gguf"), "w8a8": ("w8a8", "w8a8")}
    assert (layer.quant_method.name, model.lm_head.quant_method.name) == kept[quantization]
    assert not hasattr(layer, "weight")
    logits = _logits(llm)
    diff = (logits - float32_logits).abs()
    agreement = (logits.argmax(-1) == float32_logits.argmax(-1)).float().mean().item()
    assert diff.max().item() <= max_abs and diff.mean().item() <= mean_abs and agreement >= top1, (
        f"max {diff.max().item():.3f} mean {diff.mean().item():.3f} top-1 {agreement:.3f}"
    )


# --- w8a8's rotations (pyxllm.layers.quantization.rotation) ------------------------------------


def test_hadamard_blocks_is_the_block_diagonal_sylvester_matrix():
    from pyxllm.kernels.native.quantized import hadamard_blocks

    h = torch.ones(1, 1)
    for _ in range(3):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)  # H_8
    assert torch.equal(hadamard_blocks(torch.eye(16), 8), torch.block_diag(h, h))
    assert torch.equal(h @ h.t(), 8 * torch.eye(8))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_rotation_leaves_the_float_model_unchanged(kind, tmp_path, hf_gguf_tokenizer):
    """Rotating the residual stream and (with the online Hadamard transform of the down
    projection's input, applied here by a hook since these layers stay float) the MLP is exact
    in real arithmetic: float32 logits move by rounding only. Llama is untied, Qwen2 tied with
    QKV biases, Qwen3 has per-head q/k norms; a MoE model is left alone."""
    from pyxllm import LLM
    from pyxllm.kernels.native.quantized import hadamard_blocks
    from pyxllm.layers.quantization.rotation import rotate_for_int8_activations
    from tests.model_fixtures import build_checkpoint
    from tests.models.test_models_parity import pyxllm_last_logits

    directory, _ = build_checkpoint(kind, tmp_path / kind, hf_gguf_tokenizer)
    llm = LLM(model=str(directory), max_model_len=96, kv_cache_memory=0.05)
    model = llm.llm_engine.executor.driver.model
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    before = pyxllm_last_logits(llm, ids)
    embedding = model.model.embed_tokens.weight.clone()
    if kind == "qwen3_moe":
        assert not rotate_for_int8_activations(model)
        assert torch.equal(model.model.embed_tokens.weight, embedding)
        return
    assert rotate_for_int8_activations(model)
    assert not torch.allclose(model.model.embed_tokens.weight, embedding, atol=1e-3)
    for layer in model.model.layers:
        down = layer.mlp.down_proj
        assert down.hadamard_block == 128  # the tiny models' intermediate size
        down.register_forward_pre_hook(
            lambda mod, args: (hadamard_blocks(args[0], mod.hadamard_block),)
        )
    after = pyxllm_last_logits(llm, ids)
    assert before.std() > 1.0
    torch.testing.assert_close(after, before, atol=2e-4, rtol=0)
