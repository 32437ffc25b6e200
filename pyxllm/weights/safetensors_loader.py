"""Weights of a Hugging Face directory: one or many ``*.safetensors`` files, indexed or not.

:func:`iter_safetensors_slices` yields unread :class:`SafetensorsWeight` s, so a tensor-parallel
rank reads only its own rows or columns (``safe_open(...).get_slice(name)``);
:func:`iter_safetensors_weights` yields whole tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pyxllm.weights.errors import ModelLoadError
from pyxllm.weights.lazy import LazyWeight

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory, in a stable order.

    With ``model.safetensors.index.json``, the files its ``weight_map`` names (each must exist);
    without it, every ``*.safetensors`` in the directory, sorted by name.

    Raises:
        ModelLoadError: an unreadable index, a file the index names that is missing, or no
            safetensors file at all.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"{index} is not a valid safetensors index (no readable weight_map: {e}); "
                "re-download it."
            ) from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} names weight file(s) {', '.join(missing)} that are missing from "
                f"{directory}; download them (or re-download the whole model)."
            )
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin"))
        hint = (
            f" It holds PyTorch .bin weights ({', '.join(others[:2])}), which pyxllm does not "
            "read; "
            "convert them to safetensors."
            if others
            else ""
        )
        raise ModelLoadError(
            f"Model directory {directory} has no *.safetensors weight files.{hint}"
        )
    return files


class SafetensorsWeight(LazyWeight):
    """One tensor of an open safetensors file; ``load()`` reads only the narrowed region.

    Raises (at ``load()``):
        ModelLoadError: the file is truncated or corrupt.
    """

    def __init__(self, name: str, path: Path, handle) -> None:
        self.path, self._slice = path, handle.get_slice(name)
        super().__init__(name, tuple(self._slice.get_shape()))

    def _read(self, ranges):
        try:
            if not ranges:  # a scalar
                return self._slice[:]
            return self._slice[tuple(slice(a, b) for a, b in ranges)]
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(
                f"{self.path} is truncated or corrupt ({e}); re-download it."
            ) from e


def iter_safetensors_slices(directory: Path) -> Iterator[tuple[str, SafetensorsWeight]]:
    """Iterate ``(name, unread weight)`` over every tensor of the directory's safetensors files.

    Each weight stays readable until the next one is requested. Names are as stored.

    Raises:
        ModelLoadError: see :func:`safetensors_files` (at the call); a truncated or corrupt
            file (when reached, or when a weight is read).
    """
    return _slices(safetensors_files(directory))


def iter_safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate ``(name, tensor)`` over every tensor of the directory's safetensors files.

    Names are as stored (HF names, e.g. ``model.layers.0.self_attn.q_proj.weight``); dtypes
    are as stored (no cast). Files are memory-mapped and each tensor is read when reached.

    Raises:
        ModelLoadError: see :func:`safetensors_files` (at the call); a file that is truncated
            or corrupt (when reached).
    """
    return ((name, weight.load()) for name, weight in iter_safetensors_slices(directory))


def _slices(files: list[Path]) -> Iterator[tuple[str, SafetensorsWeight]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, SafetensorsWeight(name, path, f)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is truncated or corrupt ({e}); re-download it.") from e
