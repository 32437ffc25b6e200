"""Rotations that keep int8 activations accurate under ``--quantization w8a8`` (QuaRot's idea).

Per-token int8 quantization loses most where a few channels carry most of a token's magnitude:
the step ``max |x| / 127`` is then coarse for every other channel. Small models have such
outlier channels in the residual stream and, far larger, in the MLP's down-projection input
(measured on SmolLM2-135M: a token's max is 10-40 times its RMS). Multiplying activations by an
orthogonal matrix spreads an outlier over all channels, and a linear layer computes the same
output when its weights get the same rotation. Following QuaRot (Ashkboos et al., 2024,
"QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs"):

- the residual stream is rotated by one random orthogonal ``Q`` (hidden x hidden, seeded, so
  every TP rank draws the same): the token embedding becomes ``E Q``, each layer that reads the
  residual through an RMSNorm (``qkv_proj``, ``gate_up_proj``, the LM head) gets the norm's
  weight folded into its columns and then ``W Q``, the norm's weight becomes 1 (RMSNorm commutes
  with an orthogonal matrix, not with a per-channel scale), and each layer that writes the
  residual (``o_proj``, ``down_proj``) becomes ``Q^T W``. All exact in real arithmetic; done
  once at load in float32 (~1.5 s for SmolLM2-135M on 2 cores).
- the down-projection input (``silu(gate) * up``) has no weight before it to fold a rotation
  into, so its kernel applies a block-diagonal Hadamard matrix online (``hadamard_block``:
  ``log2(block)`` stages of sums and differences per value, fused into the activation
  quantization); the down weights get ``W H / block``, and random signs folded into the rows of
  ``up`` randomize it (``diag(signs) H`` instead of ``H``).

Measured on the default model (4 prompts, 57 positions, against float32 logits, max / mean
|diff| and top-1 agreement): W8A8 without rotation 6.8 / 0.91 / 0.86; residual rotation only
(a prototype) 6.5 / 0.77 / 0.93; both 2.6 / 0.33 / 0.93 (bfloat16 without quantization: 1.3 /
0.16 / 0.95; int8 weight-only: 3.2 / 0.39 / 0.98).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pyxllm.kernels.native.quantized import hadamard_blocks

logger = logging.getLogger(__name__)

MAX_HADAMARD_BLOCK = 512
_SEED = 0


def random_orthogonal(n: int, seed: int = _SEED) -> torch.Tensor:
    """A random ``[n, n]`` float32 orthogonal matrix, the same for a given ``seed`` on every
    process (QR of a Gaussian matrix, computed in float64)."""
    gaussian = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()


def hadamard_block_for(size: int) -> int:
    """The largest power of two dividing ``size`` (a TP rank's share of the intermediate size),
    at most ``MAX_HADAMARD_BLOCK``."""
    return min(size & -size, MAX_HADAMARD_BLOCK)


def _set_weight(layer: nn.Module, weight: torch.Tensor) -> None:
    """Replace ``layer.weight`` by ``weight`` (float32) in its dtype; a tied weight is untied."""
    layer.weight = nn.Parameter(weight.to(layer.weight.dtype), requires_grad=False)


def _rotatable(model: nn.Module) -> bool:
    """Whether ``model`` has the dense Llama layout the rotation knows (MoE layers do not)."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "layers")):
        return False
    if not hasattr(model, "lm_head"):
        return False
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (
            hasattr(layer, "input_layernorm")
            and hasattr(layer, "post_attention_layernorm")
            and hasattr(attn, "qkv_proj")
            and hasattr(attn, "o_proj")
            and hasattr(mlp, "gate_up_proj")
            and hasattr(mlp, "down_proj")
        ):
            return False
    return True


@torch.no_grad()
def rotate_for_int8_activations(model: nn.Module) -> bool:
    """Rotate ``model``'s float weights in place as the module docstring says, before they are
    quantized; returns False (nothing changed) for a layout it does not know.

    Sets ``hadamard_block`` on each ``down_proj``, which ``W8A8LinearMethod`` passes to its kernel.
    """
    if not _rotatable(model):
        logger.info(
            "w8a8: no rotation for %s (not a dense Llama-style layout)", type(model).__name__
        )
        return False
    inner = model.model
    hidden = inner.embed_tokens.weight.shape[1]
    q = random_orthogonal(hidden)
    head_weight = (
        model.lm_head.weight.float() * inner.norm.weight.float()
    )  # before the embedding changes
    _set_weight(inner.embed_tokens, inner.embed_tokens.weight.float() @ q)
    _set_weight(model.lm_head, head_weight @ q)
    inner.norm.weight.fill_(1)
    size = (
        inner.layers[0].mlp.down_proj.weight.shape[1] if len(inner.layers) else 0
    )  # this rank's share
    signs = (
        torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(_SEED + 1)).float() * 2
        - 1
    )
    block = hadamard_block_for(size)
    for layer in inner.layers:
        for norm, reader in (
            (layer.input_layernorm, layer.self_attn.qkv_proj),
            (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
        ):
            _set_weight(reader, (reader.weight.float() * norm.weight.float()) @ q)
            norm.weight.fill_(1)
        for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
            _set_weight(writer, q.t() @ writer.weight.float())
            if writer.bias is not None:
                writer.bias.copy_(writer.bias.float() @ q)
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj  # gate_up: [gate; up] rows
        if down.weight.shape[1] != size:
            raise ValueError(
                f"w8a8 rotation: layer intermediate sizes differ ({down.weight.shape[1]} vs {size})"
            )
        weight = gate_up.weight.float()
        weight[size:] *= signs.unsqueeze(1)
        _set_weight(gate_up, weight)
        if gate_up.bias is not None:
            gate_up.bias[size:] *= signs.to(gate_up.bias.dtype)
        _set_weight(
            down, hadamard_blocks(down.weight.float() * signs, block) / block
        )  # (W diag(s)) H / block
        down.hadamard_block = block
    return True
