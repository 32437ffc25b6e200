"""Pure-PyTorch weight-only quantized matmuls: the reference every platform's kernel must match.

Formats (chosen so the CPU kernels of ATen take them as they are, see ``kernels.cpu.quantized``):

- int8, per output channel: ``W[n, k] ~= qweight[n, k] * scales[n]`` with ``qweight`` int8
  ``[N, K]`` and ``scales`` ``[N]`` in the activations' dtype.
- int4, groups of ``group_size`` input features: ``W[n, k] ~= (q[n, k] - 8) * scale[g, n] +
  zero[g, n]`` with ``q`` in ``0..15`` and ``g = k // group_size``; ``scales_and_zeros`` is
  ``[K / group_size, N, 2]`` (scale, zero), in the activations' dtype. This is the layout and
  formula of ``torch._weight_int4pack_mm_for_cpu`` (checked against it in
  tests/layers/test_quantization.py).
  The reference keeps ``q`` unpacked, one ``uint8`` per weight; a platform packs ``q`` and the
  scales its own way (``pack_int4_weight``), and only its own ``int4_linear`` reads the packed
  form.
- int8 in groups of ``group_size`` (32) input features: ``W[n, k] ~= q[n, k] * scale[g, n] +
  zero[g, n]`` with ``q`` int8 ``[N, K]`` and ``scales_and_zeros`` ``[K / group_size, N, 2]`` in
  the activations' dtype: GGUF's Q8_0 blocks (zero 0) and its 5-bit ones with ``q`` made signed
  (``pyxllm.weights.gguf_blocks``), kept as stored.
- w8a8 (int8 weights and int8 activations): the int8 weight format above with ``scales`` in
  float32, and activations quantized per token when the layer runs (symmetric, dynamic:
  ``scale[m] = max_k |x[m, k]| / 127``), so the matmul itself is int8 x int8 -> int32, the
  scheme of vLLM's dynamic per-token W8A8 int8 (``compressed-tensors``) and of SmoothQuant
  (Xiao et al., 2023) without its smoothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SuperBlockScales:
    """Grouped weights' scales (and zeros) factored as GGUF's K-quants store them: per
    super-block of 256 input features and output feature a float16 ``d`` (and ``dlow``), per
    group of G input features an integer ``sc`` (and ``m``), so that with ``S = 256 / G``

        ``W[n, k] = (q[n, k] + shift) * d[g // S, n, 0] * sub[g, n, 0]``
        ``          + d[g // S, n, 1] * sub[g, n, 1]``

    (``g = k // G``, ``q`` the format's own value: int4's 0..15, grouped int8's signed one; the
    second term absent where ``P = 1``). GGUF's Q4_K and Q2_K: ``d``, ``-dmin`` and ``sc``,
    ``m``; Q5_K likewise with ``shift`` 16 (its int8 ``q`` is the stored value minus 16); Q6_K,
    Q3_K and IQ4_XS: ``d`` and their signed sub-block scales. Every product is exact in float32
    (an 11-bit by an 8-bit integer), which (scale, zero) pairs need float32 for. A pack function
    may hold these numbers as they are (the CPU's: ~0.08 byte a weight); :meth:`pairs` gives the
    equivalent pairs for one that takes pairs.

    Attributes:
        d: float32 ``[K/256, N, P]`` (float16 values), ``P`` 1 or 2.
        sub: int8 ``[K/G, N, P]``.
        shift: see the formula (0 but for Q5_K).
    """

    d: torch.Tensor
    sub: torch.Tensor
    shift: int = 0

    def pairs(self, offset: int) -> torch.Tensor:
        """``[K/G, N, 2]`` float32 (scale, zero), exact, with ``W = (q - offset) * scale +
        zero`` (``offset``: 8 for int4's ``q``, 0 for grouped int8's): ``scale = d sc`` and
        ``zero = (offset + shift) scale + dlow m`` (one rounding, gguf-py's for a Q4_K block,
        pyxllm.weights.gguf_blocks' for a Q5_K one), or ``(offset + shift) scale``."""
        d = self.d.repeat_interleave(self.sub.shape[0] // self.d.shape[0], dim=0)
        scale = d[..., 0] * self.sub[..., 0].float()
        if self.d.shape[-1] == 1:
            zero = (offset + self.shift) * scale
        else:
            zero = (offset + self.shift) * scale + d[..., 1] * self.sub[..., 1].float()
        return torch.stack((scale, zero), dim=-1)


def scale_pairs(
    scales_and_zeros: torch.Tensor | SuperBlockScales,
    offset: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``scales_and_zeros`` as ``[K/G, N, 2]`` pairs in ``dtype`` (``None``: a tensor's own, a
    :class:`SuperBlockScales`' float32): a tensor as it is, a
    :class:`SuperBlockScales` by its :meth:`~SuperBlockScales.pairs` (``offset``: the format's,
    8 for int4, 0 for grouped int8)."""
    if isinstance(scales_and_zeros, SuperBlockScales):
        scales_and_zeros = scales_and_zeros.pairs(offset)
    return scales_and_zeros if dtype is None else scales_and_zeros.to(dtype)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x @ (qweight * scales[:, None]).T + bias``.

    Args:
        x: ``[..., K]`` float activations.
        qweight: ``[N, K]`` int8; scales: ``[N]`` in ``x.dtype``; bias: ``[N]`` or None.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    y = F.linear(x, qweight.to(x.dtype)) * scales
    return y if bias is None else y + bias


def pack_int4_weight(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's int4 storage: ``q`` (``[N, K]``, values ``0..15``) as ``uint8``, unpacked,
    and ``scales_and_zeros`` (``[K/G, N, 2]``, or a :class:`SuperBlockScales`) as pairs in
    ``dtype``, the compute dtype (``None``: as given; see :func:`scale_pairs`)."""
    return q.to(torch.uint8), scale_pairs(scales_and_zeros, 8, dtype)


def dequantize_groups(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, offset: int = 0
) -> torch.Tensor:
    """``[N, K]`` weights ``(q - offset) * scale + zero`` in ``scales_and_zeros.dtype``, from
    unpacked ``q [N, K]`` and ``scales_and_zeros [K/G, N, 2]``: int4's (``offset`` 8) and grouped
    int8's (``offset`` 0) formats."""
    n, k = q.shape
    scale = scales_and_zeros[..., 0].t().unsqueeze(-1)  # [N, K/G, 1]
    zero = scales_and_zeros[..., 1].t().unsqueeze(-1)
    w = q.view(n, k // group_size, group_size).to(scales_and_zeros.dtype)
    return ((w - offset) * scale + zero).view(n, k)


def dequantize_int4(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``[N, K]`` weights in ``scales_and_zeros.dtype`` from the reference's unpacked ``q``."""
    return dequantize_groups(packed, scales_and_zeros, group_size, offset=8)


def int4_rows(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, ids: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Rows ``ids`` of the weight that ``pack_int4_weight`` stored, dequantized in float32:
    ``[len(ids), K]`` (the stored values exactly where ``scales_and_zeros`` is float32). A token
    embedding tied to an int4 LM head looks its rows up here (llama.cpp's ``get_rows`` on a
    quantized tensor), so the weight is held once.

    Args:
        packed, scales_and_zeros: from ``pack_int4_weight``; ids: ``[n]`` int64 row indices;
            group_size: ``G`` (32).
    """
    return dequantize_groups(packed[ids], scales_and_zeros[:, ids].float(), group_size, offset=8)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``y = x @ W.T + bias`` with ``W`` dequantized from ``pack_int4_weight``'s output.

    Args:
        x: ``[..., K]``; packed, scales_and_zeros: from ``pack_int4_weight``, the latter in
            ``x.dtype``; group_size: ``G`` (32); bias: ``[N]`` or None; batch_invariant: taken
            for the fused kernels' signature (this reference's ``F.linear`` promises nothing of
            the kind: BLAS may sum a row differently in batches of other sizes).
    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    return F.linear(x, dequantize_int4(packed, scales_and_zeros, group_size), bias)


def pack_int8_group_weight(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's grouped int8 storage: ``q`` (``[N, K]`` int8) and ``scales_and_zeros``
    (``[K/G, N, 2]``, or a :class:`SuperBlockScales`) as pairs in ``dtype``, the compute dtype
    (``None``: as given; see :func:`scale_pairs`)."""
    return q.to(torch.int8), scale_pairs(scales_and_zeros, 0, dtype)


def int8_group_rows(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, ids: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Rows ``ids`` of the weight that ``pack_int8_group_weight`` stored, dequantized in
    float32: ``[len(ids), K]``, as :func:`int4_rows` (``group_size`` 32 or 16)."""
    return dequantize_groups(packed[ids], scales_and_zeros[:, ids].float(), group_size)


def int8_group_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``y = x @ W.T + bias`` with ``W`` dequantized from ``pack_int8_group_weight``'s output.

    Args:
        x: ``[..., K]``; packed, scales_and_zeros: from ``pack_int8_group_weight``, the latter in
            ``x.dtype``; group_size: ``G`` (32 or 16); bias: ``[N]`` or None; batch_invariant:
            as :func:`int4_linear`'s.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    return F.linear(x, dequantize_groups(packed, scales_and_zeros, group_size), bias)


def hadamard_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [rows, K] @ blockdiag(H, ..., H)`` with ``H`` the ``block x block`` Sylvester Hadamard
    matrix (``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``, entries +-1, ``H H^T = block I``),
    by the fast Walsh-Hadamard transform's stages of sums and differences (the fused kernels'
    order, so float32 results agree bit for bit)."""
    rows, k = x.shape
    h = 1
    while h < block:
        pairs = x.reshape(rows, k // (2 * h), 2, h)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(rows, k)


def w8a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    hadamard_block: int = 0,
) -> torch.Tensor:
    """``x @ (qweight * weight_scales[:, None]).T + bias`` with ``x`` quantized to int8 per token.

    With ``hadamard_block`` > 0, ``x`` is first multiplied by the block-diagonal Hadamard matrix
    of that block size (:func:`hadamard_blocks`; the weights must have been multiplied by it too,
    see ``pyxllm.layers.quantization.rotation``). Then per row ``m`` (float32):
    ``amax = max_k |x[m, k]|``, ``q = clamp(round(x * (127 / amax)), -127, 127)`` (a row of zeros
    gives zeros); ``acc = q @ qweight.T`` exactly (integers, computed here in float64);
    ``y = x.dtype((acc * (amax / 127)) * weight_scales)``, then ``y + bias`` in ``x.dtype``.
    Every platform kernel computes this formula.

    Args:
        x: ``[..., K]`` float activations.
        qweight: ``[N, K]`` int8; weight_scales: ``[N]`` float32; bias: ``[N]`` in ``x.dtype`` or
            None.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    x2 = _flat(x).float()
    if hadamard_block:
        x2 = hadamard_blocks(x2, hadamard_block)
    amax = x2.abs().amax(dim=1, keepdim=True)
    inv = torch.where(
        amax > 0, torch.full_like(amax, 127.0) / amax, 0.0
    )  # not 127.0 / amax: a reciprocal
    q = torch.round(x2 * inv).clamp_(-127, 127)
    acc = (q.double() @ qweight.double().t()).float()
    y = (acc * (amax / 127.0) * weight_scales).to(x.dtype).view(*x.shape[:-1], qweight.shape[0])
    return y if bias is None else y + bias
