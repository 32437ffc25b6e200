"""``--quantization gguf`` (the default for a GGUF file): weights kept in the format the file
stores them in, on kernels made for it, instead of dequantized to ``--dtype``.

vLLM's GGUF support keeps each tensor's quantization blocks and multiplies by them; here the
blocks are converted once, exactly, to the two grouped formats of the CPU kernels
(``pyxllm.weights.gguf_blocks``): Q4_0, Q4_1 and Q4_K to int4 groups (``W = (q - 8) * scale +
zero``, ``kernels.ops.int4_linear``), Q8_0, the 5-bit types, IQ4_NL and IQ4_XS to int8 groups
(``W = q * scale + zero``, ``kernels.ops.int8_group_linear``), Q6_K, Q3_K and Q2_K to int8
groups of 16 (the CPU's pack holds int8 values that all lie in -32..31, every type here but
Q8_0 and the IQ4s, in 6 bits). They quantize the
activations per group of 32 to ~15 bits (see ``csrc/group_linear.cpp``), so logits stay within
~1e-3 of the dequantized model's in float32 (tests/weights/test_gguf_stored.py) with an eighth
(int4) or a quarter (int8) of float32's bytes to read per token.

How it is wired: before loading, :func:`collect_stored_weights` gives each quantizable layer's
weight (the linears, the LM head, the token embedding) a :class:`StoredRows`; the layers' weight
loaders (``layers.linear.load_rows``) hand it each region the checkpoint stores in such a format
instead of writing the float parameter, which therefore never takes memory. After loading,
:func:`apply_stored_weights` gives a layer whose every row came so a :class:`GroupedLinearMethod`
(a fused layer mixing int4 and int8 pieces, say a Q4_K query and a Q6_K value projection, is
held as int8: an int4 ``q - 8`` is an int8 value, and a group of 32 is two groups of 16 with
the same scale and zero, still exact). A layer with any region the file stores otherwise
(float tensors, the IQ types below 4 bits) is dequantized into its float weight, as without
this method. The token embedding looks its rows up from the groups (:class:`StoredEmbedding`):
a tied one from its LM head's packed buffers, so the weight is held once. A run of K-quant
pieces (and IQ4_XS) hands the pack its scales as the file factors them
(:meth:`StoredRows.super_block_scales`): the CPU's holds them so, exact at about the file's
bytes, where (scale, low) pairs would take float32 to be exact (bfloat16 pairs round them).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.kernels.native import quantized as native_quantized
from pyxllm.kernels.native.quantized import dequantize_groups
from pyxllm.layers.quantization.weight_only import UnquantizedLinearMethod, replace_weight

logger = logging.getLogger(__name__)

# what the weight q = 0 stands for, in units of the scale: W = (q - OFFSET) * scale + zero
_OFFSET = {"int4": 8, "int8": 0}


class StoredRows:
    """The regions of one weight ``[rows, cols]`` that its checkpoint stores in a grouped format
    (``pyxllm.weights.lazy.StoredGroups``: ``format``, ``q``, ``scale``, ``zero``), by first row.

    Attributes:
        rows: the rows to cover (the vocabulary rows of an embedding; the rest is padding).
        pieces: ``{first row: StoredGroups}``.
        float_rows: how many rows were written to the float parameter instead.
    """

    def __init__(self, rows: int) -> None:
        self.rows, self.pieces, self.float_rows = rows, {}, 0

    def add(self, offset: int, loaded) -> bool:
        """Keep ``loaded``'s region (rows from ``offset``) as stored, if the checkpoint stores it
        in a grouped format (``loaded.load_stored()``); ``False``: the caller writes floats."""
        load_stored = getattr(loaded, "load_stored", None)
        stored = load_stored() if load_stored is not None else None
        if stored is None:
            self.float_rows += loaded.shape[0]
            return False
        self.pieces[offset] = stored
        return True

    @property
    def complete(self) -> bool:
        """Every row came in a grouped format."""
        return self.float_rows == 0 and sum(p.q.shape[0] for p in self.pieces.values()) == self.rows

    @property
    def format(self) -> str:
        """``int4`` when every piece is, else ``int8``."""
        return "int4" if all(p.format == "int4" for p in self.pieces.values()) else "int8"

    @property
    def group_size(self) -> int:
        """The smallest of the pieces' groups (32, or 16 with a Q6_K, Q3_K or Q2_K piece)."""
        return min(p.group_size for p in self.pieces.values())

    def groups(self, total_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [total_rows, cols], scales_and_zeros [cols / G, total_rows, 2] float32)`` in
        :attr:`format` and groups of G = :attr:`group_size`, rows past :attr:`rows` zero (an
        embedding's padding)."""
        return self._q(total_rows), self._pairs(total_rows)

    def _ordered(self) -> list:
        """The pieces in row order."""
        return [self.pieces[k] for k in sorted(self.pieces)]

    def _q(self, total_rows: int) -> torch.Tensor:
        """:meth:`groups`' ``q``, padding rows standing for 0."""
        fmt = self.format
        q = torch.cat([_as_format(p, fmt) for p in self._ordered()])
        return _pad_rows(q, total_rows, _OFFSET[fmt])

    def _pairs(self, total_rows: int) -> torch.Tensor:
        """:meth:`groups`' ``scales_and_zeros``."""
        group, ordered = self.group_size, self._ordered()
        # a group of 32 is two of 16 with its scale and zero
        scale = torch.cat([p.scale.repeat_interleave(p.group_size // group, 1) for p in ordered])
        zero = torch.cat([p.zero.repeat_interleave(p.group_size // group, 1) for p in ordered])
        pairs = torch.stack((_pad_rows(scale, total_rows), _pad_rows(zero, total_rows)), dim=-1)
        return pairs.transpose(0, 1).contiguous()

    def super_block_scales(self, total_rows: int):
        """The scales of :meth:`groups` as the file factors them
        (``kernels.native.quantized.SuperBlockScales``), where every piece
        came so in :attr:`format` and :attr:`group_size` (a Q4_K_M file's Q4_K and Q6_K runs),
        else ``None``; rows past :attr:`rows` zero."""
        fmt, group, ordered = self.format, self.group_size, self._ordered()
        if (
            any(p.super_d is None or p.format != fmt or p.group_size != group for p in ordered)
            or len({(p.super_d.shape[-1], p.super_shift) for p in ordered}) != 1
        ):
            return None
        d = _pad_rows(torch.cat([p.super_d for p in ordered]), total_rows)
        sub = _pad_rows(torch.cat([p.super_sub for p in ordered]), total_rows)
        return native_quantized.SuperBlockScales(
            d.transpose(0, 1).contiguous(),
            sub.transpose(0, 1).contiguous(),
            ordered[0].super_shift,
        )

    def packed_scales(self, total_rows: int):
        """``(q, scales)`` for a pack function (called with ``dtype=`` the compute dtype):
        :meth:`groups`' ``q``, and its scales factored (:meth:`super_block_scales`) where the
        file factors them, else its float32 pairs (built only then), so that a pack that holds
        float16 pairs keeps a Q4_0, Q4_1 or Q8_0 file's numbers rather than their bfloat16
        roundings."""
        factored = self.super_block_scales(total_rows)
        scales = self._pairs(total_rows) if factored is None else factored
        return self._q(total_rows), scales

    def segments(self) -> list[StoredRows]:
        """The pieces split into runs of one format and group size, in row order, each a
        :class:`StoredRows` of its own rows (a Q4_K_M file's QKV: the int4 query and key, then
        the value's Q6_K groups of 16)."""
        runs: list[StoredRows] = []
        key = None
        for offset in sorted(self.pieces):
            piece = self.pieces[offset]
            if (piece.format, piece.group_size) != key:
                key = (piece.format, piece.group_size)
                runs.append(StoredRows(0))
            run = runs[-1]
            run.pieces[run.rows] = piece
            run.rows += piece.q.shape[0]
        return runs

    def dequantize_into(self, weight: torch.Tensor) -> None:
        """Write the stored pieces' values into their rows of the float ``weight``."""
        for offset, piece in self.pieces.items():
            pairs = torch.stack((piece.scale, piece.zero), dim=-1).transpose(0, 1)
            values = dequantize_groups(piece.q, pairs, piece.group_size, _OFFSET[piece.format])
            weight.narrow(0, offset, piece.q.shape[0]).copy_(values)


def _pad_rows(t: torch.Tensor, total_rows: int, fill: int = 0) -> torch.Tensor:
    """``t`` (rows first) with rows filled with ``fill`` up to ``total_rows``."""
    pad = total_rows - t.shape[0]
    if not pad:
        return t
    return torch.cat((t, t.new_full((pad, *t.shape[1:]), fill)))


def _as_format(piece, fmt: str) -> torch.Tensor:
    """``piece.q`` in ``fmt``: int4's ``q`` in 0..15 becomes the int8 ``q - 8`` (exact)."""
    if piece.format == fmt:
        return piece.q
    return (piece.q.to(torch.int16) - 8).to(torch.int8)


class GroupedLinearMethod(UnquantizedLinearMethod):
    """The matmul over a weight in int4 groups of 32 or int8 groups of 32 or 16
    (``kernels.ops.int4_linear`` / ``int8_group_linear``); buffers ``qweight`` and
    ``scales_and_zeros`` in the platform kernel's layout (``ops.pack_int4_weight`` /
    ``pack_int8_group_weight``), packed from pairs in the compute dtype (the CPU's fused pack
    keeps them in float16 where that holds them exactly: a Q4_0, Q4_1 or Q8_0 file's)."""

    name = "gguf"

    def __init__(self, fmt: str, group_size: int = 32, batch_invariant: bool = False) -> None:
        self.format, self.group_size = fmt, group_size
        self.batch_invariant = batch_invariant  # the kernel's row-invariant path at any count

    @property
    def pack(self):
        """The platform's pack function of :attr:`format`."""
        if self.format == "int4":
            return kernels.ops.pack_int4_weight
        return kernels.ops.pack_int8_group_weight

    @property
    def kernel(self):
        """The platform's matmul of :attr:`format`."""
        return kernels.ops.int4_linear if self.format == "int4" else kernels.ops.int8_group_linear

    def process_stored(self, layer: nn.Module, stored: StoredRows) -> None:
        """Replace ``layer.weight`` by ``stored``'s groups, packed."""
        q, scales = stored.packed_scales(layer.weight.shape[0])
        packed, scales_and_zeros = self.pack(q, scales, dtype=layer.weight.dtype)
        replace_weight(layer, qweight=packed, scales_and_zeros=scales_and_zeros)
        layer.quant_method = self

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernel(
            x, layer.qweight, layer.scales_and_zeros, self.group_size, bias, self.batch_invariant
        )


class SplitGroupedLinearMethod(UnquantizedLinearMethod):
    """A fused layer whose pieces the file stores in different grouped formats (a Q4_K_M file's
    QKV: Q4_K query and key, Q6_K value), each run of one format kept in it: the runs' outputs
    are computed by their own kernels and concatenated. Held whole in the widest format
    instead, an int4 query would take int8's (or 6 bits') bytes and scales per 16 inputs.

    Args:
        parts: one :class:`GroupedLinearMethod` a run, in row order, each with its rows;
            buffers ``qweight_{i}`` and ``scales_and_zeros_{i}``.
    """

    name = "gguf"

    def __init__(self, parts: list[tuple[GroupedLinearMethod, int]]) -> None:
        self.parts = parts

    @property
    def format(self) -> str:
        """The runs' formats, e.g. ``int4+int8/16``."""
        return "+".join(
            m.format + ("" if m.group_size == 32 else f"/{m.group_size}") for m, _ in self.parts
        )

    def process_stored(self, layer: nn.Module, runs: list[StoredRows]) -> None:
        """Replace ``layer.weight`` by each run's groups, packed."""
        dtype, buffers = layer.weight.dtype, {}
        for i, ((method, _), run) in enumerate(zip(self.parts, runs, strict=True)):
            q, scales = run.packed_scales(run.rows)
            packed, scales_and_zeros = method.pack(q, scales, dtype=dtype)
            buffers |= {f"qweight_{i}": packed, f"scales_and_zeros_{i}": scales_and_zeros}
        replace_weight(layer, **buffers)
        layer.quant_method = self

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        outputs, start = [], 0
        for i, (method, rows) in enumerate(self.parts):
            part_bias = None if bias is None else bias[start : start + rows]
            outputs.append(
                method.kernel(
                    x,
                    getattr(layer, f"qweight_{i}"),
                    getattr(layer, f"scales_and_zeros_{i}"),
                    method.group_size,
                    part_bias,
                    method.batch_invariant,
                )
            )
            start += rows
        return torch.cat(outputs, dim=-1)


class StoredEmbedding:
    """Token embedding rows from grouped weights: ``(q[ids] - offset) * scale + zero`` in float32,
    then the compute dtype (with float32 or exact float16 pairs, the file's values exactly, as
    gguf-py dequantizes them).

    Args:
        packed, scales_and_zeros: the groups in the layout ``read_rows`` takes: the reference's
            unpacked ``[rows, hidden]`` and ``[hidden / G, rows, 2]`` float32 for an embedding of
            its own, or a tied LM head's packed buffers (its kernel's layout, in the compute
            dtype); read_rows: ``kernels.ops.int4_rows``-like, ``(packed, scales_and_zeros, ids
            [n], G) -> [n, hidden]`` float32; group_size: G; dtype: the output's.
    """

    def __init__(self, packed, scales_and_zeros, read_rows, group_size: int, dtype) -> None:
        self.packed, self.scales_and_zeros = packed, scales_and_zeros
        self.read_rows, self.group_size, self.dtype = read_rows, group_size, dtype
        # the compile runner's torch._dynamo.mark_unbacked (None on other runners), see below
        self.mark_unbacked = None

    # outside torch.compile's graph: indexing the tiles by ids of the unbacked token count
    # made inductor guard on that count (GuardOnDataDependentSymNode), so the compile runner
    # failed on every GGUF model kept as stored; eager, the lookup is a few small ops. The
    # graph resumes after it with these rows as an input, whose token dimension the compile
    # runner has marked unbacked too: else dynamo specialized it at 1, and the first
    # single-token step compiled the model again (~30 s).
    @torch.compiler.disable
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        values = self.read_rows(
            self.packed, self.scales_and_zeros, ids.reshape(-1), self.group_size
        )
        rows = values.to(self.dtype).view(*ids.shape, -1)
        if self.mark_unbacked is not None:
            self.mark_unbacked(rows, 0)
        return rows


# the reference's row readers, over the unpacked groups an embedding of its own keeps
_OWN_ROWS = {"int4": native_quantized.int4_rows, "int8": native_quantized.int8_group_rows}
# the platform's row reader of each format's packed layout (None where it has none)
_PACKED_ROWS = {"int4": "int4_rows", "int8": "int8_group_rows"}


def _is_embedding(module: nn.Module) -> bool:
    """A token embedding (rows looked up), not a layer that multiplies (the LM head is both an
    embedding's subclass and quantizable)."""
    return hasattr(module, "stored_lookup") and not getattr(module, "quantizable", False)


def _stored_targets(model: nn.Module):
    """``(module name, module)`` of every layer whose weight may be kept as stored: quantizable
    layers (linears, the LM head) and token embeddings."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if getattr(module, "quantizable", False) or _is_embedding(module):
            yield name, module


def collect_stored_weights(model: nn.Module) -> None:
    """Before loading: give each target layer's weight a :class:`StoredRows` (a tied LM head
    shares its embedding's)."""
    for _, module in _stored_targets(model):
        weight = module.weight
        if getattr(weight, "stored_rows", None) is None:
            rows = weight.shape[0]
            if hasattr(module, "num_embeddings"):  # rows past the vocabulary are padding
                rows = max(0, min(module.num_per_rank, module.num_embeddings - module.vocab_start))
            weight.stored_rows = StoredRows(rows)


def apply_stored_weights(
    model: nn.Module, batch_invariant: bool = False, keep: tuple[str, ...] = ("int4", "int8")
) -> Counter:
    """After loading: each target layer on its stored groups where all its rows came so in a
    format of ``keep`` (token embeddings: in any format, since looking rows up needs no
    kernel), else its float weight (the stored pieces dequantized into it); returns how many
    layers took each way (``int4``, ``int8``, ``float``). Layers the checkpoint stores no
    grouped piece of are left as loaded and not counted."""
    taken: Counter = Counter()
    # the layers first, so that a tied embedding finds its LM head's packed groups
    targets = sorted(_stored_targets(model), key=lambda target: _is_embedding(target[1]))
    packed_by: dict[int, nn.Module] = {}  # id(StoredRows) -> the layer that packed them
    for _, module in targets:
        stored = getattr(module.weight, "stored_rows", None)
        if stored is None or not stored.pieces:
            continue
        embedding = _is_embedding(module)  # looked up: no kernel tiles to fit
        kept = embedding or (_fits(module.weight.shape) and stored.format in keep)
        if not stored.complete or not kept:
            stored.dequantize_into(module.weight.data)
            taken["float"] += 1
        elif embedding:
            module.stored_lookup = _embedding_lookup(module, stored, packed_by.get(id(stored)))
            taken[stored.format] += 1
        elif (runs := _split_runs(stored, keep)) is not None:
            parts = [
                (GroupedLinearMethod(run.format, run.group_size, batch_invariant), run.rows)
                for run in runs
            ]
            SplitGroupedLinearMethod(parts).process_stored(module, runs)
            taken["split"] += 1
        else:
            method = GroupedLinearMethod(stored.format, stored.group_size, batch_invariant)
            method.process_stored(module, stored)
            packed_by[id(stored)] = module
            taken[stored.format] += 1
    for _, module in targets:  # after every user of a shared (tied) weight is done
        weight = getattr(module, "weight", None)
        if weight is not None and hasattr(weight, "stored_rows"):
            del weight.stored_rows  # an embedding's float weight stays unwritten (no memory)
    if not taken:
        return taken
    logger.info(
        "weights kept as the GGUF file stores them: %d layers as int4 groups, %d as int8 groups, "
        "%d split by piece between formats, %d dequantized to %s (--quantization none "
        "dequantizes every layer)",
        taken["int4"],
        taken["int8"],
        taken["split"],
        taken["float"],
        str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    return taken


def _embedding_lookup(
    module: nn.Module, stored: StoredRows, tied_head: nn.Module | None
) -> StoredEmbedding:
    """The rows of ``module`` (an embedding): read out of its tied LM head's packed groups where
    the platform can read that layout (one copy of the weight), else from a copy of their own."""
    read_rows = getattr(kernels.ops, _PACKED_ROWS[stored.format], None)
    if tied_head is not None and read_rows is not None:
        return StoredEmbedding(
            tied_head.qweight,
            tied_head.scales_and_zeros,
            read_rows,
            stored.group_size,
            module.weight.dtype,
        )
    q, scales_and_zeros = stored.groups(module.weight.shape[0])
    return StoredEmbedding(
        q, scales_and_zeros, _OWN_ROWS[stored.format], stored.group_size, module.weight.dtype
    )


def _split_runs(stored: StoredRows, keep: tuple[str, ...]) -> list[StoredRows] | None:
    """``stored``'s runs of one format (:meth:`StoredRows.segments`) where there are several,
    each in a format of ``keep`` and of whole tiles (rows a multiple of 16); else ``None`` (the
    layer is held whole)."""
    runs = stored.segments()
    if len(runs) < 2 or any(run.format not in keep or run.rows % 16 for run in runs):
        return None
    return runs


def _fits(shape: torch.Size) -> bool:
    """The kernels' tiles: output features in multiples of 16, input features of 32."""
    return shape[0] % 16 == 0 and shape[1] % 32 == 0
