"""``--quantization``: int8/int4 weight-only or int8 W8A8 linear layers, chosen once the weights are
loaded; or ``gguf``: a GGUF file's weights kept in the format it stores them in (``stored.py``).

Layers with a ``quant_method`` attribute (the column/row-parallel linears and the LM head) and
``quantizable = True`` are converted by :func:`quantize_model`; the others (norms, the token
embedding, a MoE router, stacked MoE experts) stay in the compute dtype. See
``weight_only.py`` and ``w8a8.py`` for the formats and docs/performance.md for speed and accuracy.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pyxllm.layers.quantization.rotation import rotate_for_int8_activations
from pyxllm.layers.quantization.stored import apply_stored_weights, collect_stored_weights
from pyxllm.layers.quantization.w8a8 import W8A8LinearMethod
from pyxllm.layers.quantization.weight_only import (
    INT4_GROUP_SIZE,
    UNQUANTIZED,
    Int4LinearMethod,
    Int8LinearMethod,
    UnquantizedLinearMethod,
    make_row_invariant,
    quantize_int4_groups,
    quantize_int8_per_channel,
)

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "gguf")
# --quantization -> (method of the decoder linears, method of the LM head)
_METHODS = {
    "int8": (Int8LinearMethod, W8A8LinearMethod),
    "int4": (Int4LinearMethod, W8A8LinearMethod),
    "w8a8": (W8A8LinearMethod, W8A8LinearMethod),
}

__all__ = [
    "INT4_GROUP_SIZE",
    "QUANTIZATION_METHODS",
    "UNQUANTIZED",
    "Int4LinearMethod",
    "Int8LinearMethod",
    "UnquantizedLinearMethod",
    "W8A8LinearMethod",
    "quantize_int4_groups",
    "quantize_int8_per_channel",
    "prepare_model",
    "quantize_model",
    "resolve_quantization",
    "weight_bytes",
    "weight_tensors",
]


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the model's weights are held in, each once: its parameters and buffers, and
    the groups an embedding looks its rows up from, less the float weights of such embeddings
    (allocated, never written, so never resident)."""
    looked_up = {
        id(m.weight) for m in model.modules() if getattr(m, "stored_lookup", None) is not None
    }
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in looked_up}
    for module in model.modules():
        lookup = getattr(module, "stored_lookup", None)
        if lookup is not None:  # (a tied LM head's buffers, counted once)
            tensors |= {id(t): t for t in (lookup.packed, lookup.scales_and_zeros)}
    return list(tensors.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take in memory (:func:`weight_tensors`)."""
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


# names what ``--quantization auto`` picks instead of its own choice (the suite pins ``none``)
DEFAULT_ENV = "PYXLLM_DEFAULT_QUANTIZATION"


def resolve_quantization(quantization: str | None, checkpoint_kind: str) -> str | None:
    """The method ``--quantization`` stands for on a checkpoint of ``checkpoint_kind`` (``gguf``
    or ``hf``): ``auto`` is ``gguf`` on a GGUF file (its weights as stored: llama.cpp's and
    vLLM's behaviour, and the fastest path), else ``None``; ``$PYXLLM_DEFAULT_QUANTIZATION``
    overrides that choice (``none``, or a method).

    Raises:
        ValueError: ``gguf`` for a checkpoint that is not a GGUF file, or a bad override.
    """
    if quantization == "auto":
        override = os.environ.get(DEFAULT_ENV, "").strip().lower()
        if override:
            if override not in ("none", *QUANTIZATION_METHODS):
                raise ValueError(
                    f"{DEFAULT_ENV}: must be none or one of {', '.join(QUANTIZATION_METHODS)}, "
                    f"got {override!r}"
                )
            quantization = None if override == "none" else override
            if quantization == "gguf" and checkpoint_kind != "gguf":
                quantization = None
        else:
            quantization = "gguf" if checkpoint_kind == "gguf" else None
    if quantization == "gguf" and checkpoint_kind != "gguf":
        raise ValueError(
            "--quantization gguf: keeps a GGUF file's weights as stored, but the model is not "
            "a GGUF file; use auto, none, int8, int4 or w8a8"
        )
    return quantization


# the stored formats each method keeps as the checkpoint stores them, rather than quantizing the
# dequantized weights again: a GGUF file's Q4_0 layer under --quantization int4 keeps the file's
# own int4 groups (a second rounding would only lose accuracy)
_KEEPS_STORED = {"gguf": ("int4", "int8"), "int4": ("int4",), "int8": ("int8",)}


def prepare_model(model: nn.Module, quantization: str | None) -> None:
    """Before loading: ``gguf``, ``int4`` and ``int8`` make the layers keep what the checkpoint
    stores in a format a kernel takes (``stored.collect_stored_weights``; a checkpoint that
    stores none, a Hugging Face directory, loads as without it); ``w8a8`` needs nothing."""
    if quantization in _KEEPS_STORED:
        collect_stored_weights(model)


def quantize_model(
    model: nn.Module, quantization: str | None, batch_invariant: bool = False
) -> int:
    """Convert every quantizable layer of a loaded ``model`` in place; returns how many.
    ``batch_invariant`` puts the int4/int8 group matmuls on their row-invariant path at any row
    count (``--batch-invariant``; the methods that support it keep it as their attribute), and
    the layers left in float on the platform's row-invariant ``linear`` where it has one
    (``weight_only.make_row_invariant``).

    ``gguf`` (after :func:`prepare_model`) puts each layer on the groups its checkpoint stored
    (see ``stored.py``); ``int4`` and ``int8`` do so for the layers a GGUF file stores in their
    own grouped format (int4: Q4_0, Q4_1, Q4_K; int8: the others) and quantize the rest; the
    methods quantize the loaded float weights so:

    The LM head (a module with ``compute_logits``) takes the second method of the pair in
    ``_METHODS``: W8A8 for every choice. Its weights stay int8 (its rows are the vocabulary: an
    int4 head lost top-1 agreement with float32, an int8 one keeps it), and quantizing its
    activations too runs it on int8 kernels: at batch 1 that is ~1 ms of a ~8 ms int4 decode
    step saved (+13 % tok/s) for logits about as close to float32 as bfloat16's
    (docs/performance.md). ``w8a8`` first rotates the float weights (``rotation.py``).

    Raises:
        ValueError: an unknown method, or a layer whose shape the method cannot hold (naming
            the layer and the flag).
    """
    if quantization is None:
        if batch_invariant:
            make_row_invariant(model)
        return 0
    kept = 0
    if quantization in _KEEPS_STORED:
        taken = apply_stored_weights(model, batch_invariant, _KEEPS_STORED[quantization])
        kept = taken["int4"] + taken["int8"] + taken["split"]
        if quantization == "gguf":
            if batch_invariant:  # the layers the file stores in float
                make_row_invariant(model)
            return kept
    if quantization not in _METHODS:
        raise ValueError(
            f"--quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got "
            f"{quantization!r}"
        )
    linear_cls, head_cls = _METHODS[quantization]
    if quantization == "w8a8":
        rotate_for_int8_activations(model)
    count = 0
    for name, module in model.named_modules():
        if not getattr(module, "quantizable", False) or not isinstance(
            getattr(module, "weight", None), nn.Parameter
        ):
            continue
        method = head_cls() if hasattr(module, "compute_logits") else linear_cls()
        if hasattr(method, "batch_invariant"):
            method.batch_invariant = batch_invariant
        try:
            method.process_weights_after_loading(module)
        except (ValueError, RuntimeError) as e:
            raise ValueError(
                f"--quantization {quantization}: layer {name} {tuple(module.weight.shape)}: {e}"
            ) from e
        count += 1
    logger.info("quantized %d layers to %s", count, quantization)
    return count + kept
