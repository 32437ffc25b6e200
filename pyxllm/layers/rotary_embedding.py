"""Rotary position embedding (Su et al. 2021, RoFormer) with the rope_scaling kinds we support.

Frequencies follow transformers' ``modeling_rope_utils``: ``inv_freq[i] = base ** (-2i / dim)``;
``linear`` divides them by ``factor``; ``llama3`` (Llama 3.1) divides the low frequencies by
``factor``, keeps the high ones and interpolates in between; ``longrope`` (Phi-3's LongRoPE,
formerly ``su``) divides each by its own ``short_factor`` or ``long_factor`` and scales cos and
sin by an attention factor (see :func:`_longrope_inv_freq` for which factors). ``dim`` is the
rotary width: all of ``head_dim``, or its first ``rotary_dim`` channels (a partial rotary
factor, e.g. Phi-4-mini's 0.75); the other channels pass through unrotated.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.layers.forward_context import current_forward_context

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# (rotary parameters, device) -> cos/sin table: layers with the same parameters hold one table
# (a 128k-position table of a 128-wide head is 64 MiB), kept while a module holds it
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_inv_freq(
    base: float, dim: int, max_position: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """LongRoPE's ``(inv_freq, attention_factor)`` for an embedding of ``max_position`` positions.

    One set of factors serves every position: ``long_factor`` when ``max_position`` (the
    context the engine serves, ``--max-model-len``) exceeds
    ``original_max_position_embeddings``, else ``short_factor``. This is vLLM's rule; it keeps a
    token's rotation independent of the batch and of the step that computed it, so cached K,
    prefix-cache blocks and chunked prefill agree. transformers instead picks per forward call,
    by the longest position in it: it agrees with this rule for sequences of any length when
    ``--max-model-len`` is at most ``original_max_position_embeddings`` (short factors) and
    for prompts longer than it (long factors), and differs for shorter sequences run with a
    larger ``--max-model-len`` (here long factors, there short ones, switching to long
    mid-generation past the limit).

    ``attention_factor`` defaults as in transformers: ``sqrt(1 + ln(factor) / ln(original))``
    for ``factor > 1``, else 1; ``factor`` (the model's ``max_position_embeddings / original``)
    must be in ``scaling``.
    """
    original = scaling["original_max_position_embeddings"]
    key = "long_factor" if max_position > original else "short_factor"
    ext = torch.tensor(scaling[key], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(
            f"rope_scaling {key} has {ext.numel()} entries; the rotary width {dim} needs {dim // 2}"
        )
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        )
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q [num_tokens, heads, head_dim]`` and ``k [num_tokens, kv_heads,
    head_dim]``.

    Holds ``cos_sin_cache`` ``[max_position, rotary_dim]`` float32, computed once and shared by
    every rotary embedding with the same parameters on the same device.
    ``rotary_dim`` (default ``head_dim``): only each head's first ``rotary_dim`` channels are
    rotated.

    Raises:
        ValueError: a rope_scaling type other than ``default``, ``linear``, ``llama3`` or
            ``longrope`` (``su``), or LongRoPE factors of the wrong length.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        # layers with the same rotary parameters share one table, and one cos/sin per step
        self._signature = (
            "rope",
            head_dim,
            self.rotary_dim,
            max_position,
            base,
            repr(sorted((scaling or {}).items())),
        )
        key = (self._signature, str(torch.empty(0).device))
        table = _TABLES.get(key)
        if table is None:
            table = _TABLES[key] = self._table(rope_type, max_position, base, scaling)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _table(
        self, rope_type: str, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> torch.Tensor:
        """``[max_position, rotary_dim]`` float32: cos then sin of each position's angles."""
        dim, attention_factor = self.rotary_dim, 1.0
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope_inv_freq(base, dim, max_position, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return cos_sin * attention_factor if attention_factor != 1.0 else cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k``. Inside an eager forward pass, the step's ``cos``/``sin`` are
        computed by the first layer and shared by the others (``ForwardContext.step_cache``,
        keyed by the rotary parameters); a compiled forward fuses them instead."""
        if self.rotary_dim < self.head_dim:  # rotate the first channels, pass the rest through
            rot = self.rotary_dim
            q_rot, k_rot = self._rotate(positions, q[..., :rot], k[..., :rot])
            return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat(
                (k_rot, k[..., rot:]), dim=-1
            )
        return self._rotate(positions, q, k)

    def _rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = None if torch.compiler.is_compiling() else current_forward_context()
        if ctx is None and positions.dim() == 1:
            return kernels.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
        # keyed by the positions' rank too: an mRoPE step's [3, T] tables are not [T]'s
        key = (self._signature, positions.dim(), q.dtype)
        cos_sin = None if ctx is None else ctx.step_cache.get(key)
        if cos_sin is None:
            cos_sin = self._cos_sin(positions, q.dtype)
            if ctx is not None:
                ctx.step_cache[key] = cos_sin
        return kernels.ops.apply_rotary_emb(q, k, *cos_sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)`` of ``positions [T]`` in ``dtype``, as ``apply_rotary_emb`` takes them."""
        return kernels.ops.rotary_cos_sin(positions, self.cos_sin_cache, dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL; vLLM's ``MRotaryEmbedding``, transformers'
    ``Qwen2_5_VLRotaryEmbedding``): the ``head_dim // 2`` frequencies are cut into sections of
    ``mrope_section`` sizes (e.g. ``[16, 24, 24]`` of 64), and section ``j`` rotates by
    component ``j % 3`` of the token's ``(temporal, height, width)`` position. ``interleaved``
    (Qwen3-VL's ``Qwen3VLTextRotaryEmbedding``): frequency ``i`` reads the height when ``i % 3
    == 1`` and ``i < 3 * mrope_section[1]``, the width when ``i % 3 == 2`` and ``i < 3 *
    mrope_section[2]``, else the temporal component.

    ``positions`` is ``int64 [3, T]`` (see :func:`pyxllm.multimodal_inputs.mrope_positions`) or
    ``[T]``: a step without image tokens, each token's three components equal, where every
    section reads the same position and this is plain RoPE.

    Raises:
        ValueError: ``mrope_section`` does not add up to ``head_dim // 2``, or what
            :class:`RotaryEmbedding` raises.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
        scaling: dict[str, Any] | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, max_position, base, scaling)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} adds up to {sum(mrope_section)}; the rotary "
                f"width {head_dim} has {head_dim // 2} frequencies"
            )
        # which position component (0 temporal, 1 height, 2 width) each frequency reads
        if interleaved:
            component = [
                i % 3 if i % 3 and i < 3 * mrope_section[i % 3] else 0 for i in range(head_dim // 2)
            ]
        else:
            component = [j % 3 for j, size in enumerate(mrope_section) for _ in range(size)]
        self.register_buffer("component", torch.tensor(component), persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[T, 1, head_dim]`` in ``dtype``, of ``positions [3, T]``:
        frequency ``i`` at component ``component[i]``'s position, repeated over both halves
        (``[T]``: plain RoPE's)."""
        if positions.dim() == 1:
            return super()._cos_sin(positions, dtype)
        half = self.rotary_dim // 2
        table = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        index = self.component.view(1, 1, half).expand(1, positions.shape[1], half)
        cos = table[..., :half].gather(0, index)[0]
        sin = table[..., half:].gather(0, index)[0]
        return (
            cos.repeat(1, 2).unsqueeze(1).to(dtype),
            sin.repeat(1, 2).unsqueeze(1).to(dtype),
        )
