"""A PEFT LoRA adapter read from its directory and laid onto a loaded model's fused layers.

PEFT (``LoraConfig``; Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
saves ``adapter_config.json`` and ``adapter_model.safetensors`` with, per target module, ``...
.q_proj.lora_A.weight [r, in]`` and ``....q_proj.lora_B.weight [out, r]``; the adapted layer
computes ``W x + B A x * scaling`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with ``use_rslora``, Kalajdzievski 2023). Our models fuse q/k/v and gate/up into one layer
(``packed_modules_mapping``), so an adapter's pieces for one fused layer are gathered: their A
matrices side by side in one ``[in, sum r]`` matrix (one pass over the inputs), each B kept
with the output slice and rank columns it covers (see :class:`LoRALayerWeights`). ``scaling``
is folded into B once, at load.

What vLLM refuses we refuse, by name: DoRA (``use_dora``), trained biases (``bias`` other
than ``"none"``), ``modules_to_save`` (whole replaced layers such as a new LM head), embedding
adapters, per-module ``rank_pattern`` / ``alpha_pattern``, ranks above ``--max-lora-rank``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from pyxllm.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# what PEFT puts before the base model's own module names
_PEFT_PREFIX = "base_model.model."
# a layer's stacked rank is padded with zeros to a multiple of this: the lora_delta kernel
# computes 8 rank columns to a vector
RANK_ALIGNMENT = 8


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and what is wrong.

    Attributes:
        not_found: the directory or one of its files does not exist (an HTTP 404; else 400).
    """

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


@dataclass(slots=True)
class LoRALayerWeights:
    """An adapter's weights for one layer, in the layout of ``kernels.ops.lora_delta``.

    Attributes:
        a: ``[in, R]``, the ``lora_A`` of each adapted checkpoint module inside the layer,
            transposed and side by side (``R`` the sum of their ranks, padded with zero columns
            to a multiple of :data:`RANK_ALIGNMENT`), so the layer's inputs go through every
            module's A in one pass.
        b: 1-D, each module's ``lora_B * scaling`` transposed (``[rank, out features]``), one
            after the other: only a module's own output features and rank columns are stored
            (q/k/v's or gate/up's blocks, not the zeros around them).
        segments: ``int64 [M, 5]``, per module ``(out_start, out_len, rank_start, rank_len,
            b_offset)``: its output features in the layer, its columns of ``a``, where its
            block starts in ``b``.
    ``a`` and ``b`` are bfloat16 when the model runs in bfloat16, else float32.
    """

    a: torch.Tensor
    b: torch.Tensor
    segments: torch.Tensor


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: its request and its weights by our layer's module path.

    Attributes:
        request: what named and located it.
        rank: its largest rank.
        layers: ``{module path: LoRALayerWeights}`` on the model's device.
    """

    request: LoRARequest
    rank: int
    layers: dict[str, LoRALayerWeights]

    @property
    def nbytes(self) -> int:
        """Bytes its weights take."""
        return sum(w.a.nbytes + w.b.nbytes + w.segments.nbytes for w in self.layers.values())


def output_slice(layer: nn.Module, shard) -> tuple[int, int]:
    """``(offset, size)`` of checkpoint piece ``shard`` in ``layer``'s output features: a
    QKV layer's ``"q"``/``"k"``/``"v"``, a merged layer's index, or ``None`` for the whole
    layer (one rank's features; adapters run on one rank)."""
    if shard is None:
        return 0, layer.output_size
    if isinstance(shard, str):  # QKVParallelLinear
        q_size = layer.num_heads * layer.head_dim
        kv_size = layer.num_kv_heads * layer.head_dim
        return {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard]
    sizes = layer.output_sizes  # MergedColumnParallelLinear
    return sum(sizes[:shard]), sizes[shard]


def _read_config(request: LoRARequest) -> dict:
    path = Path(request.lora_path)
    if not path.is_dir():
        raise LoRAAdapterError(
            f"LoRA adapter {request.lora_name!r}: no directory {request.lora_path}", True
        )
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(
            f"LoRA adapter {request.lora_name!r}: no {CONFIG_FILE} in {request.lora_path}", True
        )
    try:
        return json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(
            f"LoRA adapter {request.lora_name!r}: {CONFIG_FILE} is not JSON ({exc})"
        ) from exc


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """``(r, scaling)`` of a PEFT LoRA config, after refusing what we cannot serve."""
    refuse = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for field, bad in refuse.items():
        if bad:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {field}={config.get(field)!r} is not supported (plain "
                "LoRA on linear layers only: no DoRA, trained biases, modules_to_save or "
                "per-module rank/alpha patterns)"
            )
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {CONFIG_FILE} needs an integer r ({exc})"
        ) from exc
    if not 0 < rank <= max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}"
            if rank > max_rank
            else f"LoRA adapter {name!r}: rank must be >= 1, got {rank}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _module_of(model: nn.Module, peft_name: str):
    """``(our module path, layer, shard)`` for a PEFT module name, or ``None`` when the model
    has no such linear layer."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    rename = getattr(model, "rename_checkpoint_tensor", None)
    if rename is not None:
        renamed = rename(name + ".weight")
        if renamed is None:
            return None
        name = renamed.removesuffix(".weight")
    parent, _, leaf = name.rpartition(".")
    fused, shard = getattr(model, "packed_modules_mapping", {}).get(leaf, (leaf, None))
    path = f"{parent}.{fused}" if parent else fused
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    if not hasattr(layer, "quant_method") or not hasattr(layer, "output_size"):
        return None
    return path, layer, shard


def load_adapter(
    request: LoRARequest,
    model: nn.Module,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAAdapter:
    """Read ``request``'s adapter and lay it onto ``model``'s layers (see the module docstring).

    Raises:
        LoRAAdapterError: a missing directory or file (``not_found``), an unsupported config,
            a rank above ``max_rank``, or tensors that do not fit the model (a module it does
            not have, A/B shapes other than the layer's), each naming the adapter.
    """
    name = request.lora_name
    rank, scaling = _check_config(name, _read_config(request), max_rank)
    weights_path = Path(request.lora_path) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {request.lora_path} (PEFT's "
            "safetensors format only)",
            True,
        )
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE}: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, dot, kind = key.removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B") or not dot:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key} is not a LoRA A/B matrix (embedding "
                "adapters and other PEFT tensors are not supported)"
            )
        pairs.setdefault(module, {})[kind] = tensor
    stacked: dict[str, tuple[nn.Module, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        found = _module_of(model, module)
        if found is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: the model has no linear layer for {module}"
            )
        path, layer, shard = found
        a, b = pair["lora_A"], pair["lora_B"]
        offset, size = output_slice(layer, shard)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} are not a rank <= {max_rank} pair"
            )
        if a.shape[1] != layer.input_size or b.shape[0] != size:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the base model's layer ({layer.input_size} inputs, "
                f"{size} outputs): an adapter trained for another model?"
            )
        stacked.setdefault(path, (layer, []))[1].append((offset, a, b))
    layers = {}
    for path, (layer, parts) in stacked.items():
        total = sum(a.shape[0] for _, a, _ in parts)
        padded = -(-total // RANK_ALIGNMENT) * RANK_ALIGNMENT
        a_all = torch.zeros(layer.input_size, padded, dtype=torch.float64)
        b_blocks, segments = [], []
        start = b_offset = 0
        for offset, a, b in parts:
            rank, size = a.shape[0], b.shape[0]
            a_all[:, start : start + rank] = a.double().t()
            b_blocks.append((b.double() * scaling).t().reshape(-1))
            segments.append((offset, size, start, rank, b_offset))
            start += rank
            b_offset += rank * size
        layers[path] = LoRALayerWeights(
            a_all.to(dtype=dtype, device=device),
            torch.cat(b_blocks).to(dtype=dtype, device=device),
            torch.tensor(segments, dtype=torch.long, device=device),
        )
    return LoRAAdapter(request, rank, layers)
