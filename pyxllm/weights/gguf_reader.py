"""A fast, read-only GGUF parser: metadata, tensor table and per-tensor dequantization.

Layout (GGUF v2/v3, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian:
``b"GGUF"``, u32 version, u64 tensor count, u64 metadata count, then the metadata key/values,
then one entry per tensor (name, u32 n_dims, u64 dims fastest-first, u32 ggml type, u64
offset), then the tensor data starting at the next ``general.alignment`` (default 32) boundary.

``gguf.GGUFReader`` builds a numpy view per vocabulary string and takes ~2.5 s on the default
model; this parser reads the strings straight into Python objects (~0.1 s). Dequantization is
``gguf.quants.dequantize`` (vectorized numpy). Files are parsed once per (path, size, mtime).
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pyxllm.weights.errors import ModelLoadError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Corrupt(Exception):
    """Internal: the bytes do not form a valid GGUF file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the tensor table.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        shape: shape in torch order (slowest dimension first; GGUF stores it reversed).
        ggml_type: the storage type (``gguf.GGMLQuantizationType``).
        start: absolute byte offset of the data in the file.
        nbytes: size of the stored data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    start: int
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> Python value), ``tensors`` (in file order).

    Use :func:`open_gguf` rather than the constructor, so a file is parsed only once.

    Raises:
        ModelLoadError: the file is not GGUF, is a version other than 2/3, is truncated or
            corrupt, or holds a tensor type that ``gguf`` cannot dequantize.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ModelLoadError(_corrupt_message(path, "it is empty")) from e
        if self._map[:4] != b"GGUF":
            raise ModelLoadError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
                "pass a .gguf model file or a Hugging Face model directory."
            )
        try:
            self.metadata, self.tensors = self._parse()
        except (_Corrupt, struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(_corrupt_message(path, str(e) or type(e).__name__)) from e
        self.tensor_by_name = {t.name: t for t in self.tensors}
        self._array = np.frombuffer(self._map, dtype=np.uint8)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory. They stay in the page
        cache, and a later read faults them back in. A loaded model holds its weights in its
        own tensors, and :func:`open_gguf` keeps the file mapped. Without this, the whole file
        stayed resident after loading (603 MiB for a 1B Q4_0 file)."""
        if hasattr(mmap, "MADV_DONTNEED"):  # (not on Windows)
            self._map.madvise(mmap.MADV_DONTNEED)

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise ModelLoadError(
                f"{self.path} is GGUF version {version}; pyxllm reads versions 2 and 3. "
                "Re-convert it with a recent llama.cpp."
            )
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", self._map, pos)
            metadata[key], pos = self._value(vtype, pos + 4)
        entries = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", self._map, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, pos + 4)
            gtype, offset = struct.unpack_from("<IQ", self._map, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(reversed(dims)), gtype, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        tensors = []
        for name, shape, gtype, offset in entries:
            try:
                qtype = GGMLQuantizationType(gtype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelLoadError(
                    f"{self.path}: tensor {name} has ggml type {gtype}, which the gguf "
                    "package cannot read; upgrade it (pip install -U gguf)."
                ) from None
            if shape and shape[-1] % block:
                raise _Corrupt(
                    f"tensor {name} has a row of {shape[-1]} values, not a multiple of {block}"
                )
            nbytes = prod(shape) // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise _Corrupt(
                    f"tensor {name} ends at byte {start + nbytes}, past the end of the "
                    f"{len(self._map)}-byte file"
                )
            tensors.append(GGUFTensorInfo(name, shape, qtype, start, nbytes))
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + length
        if end > len(self._map):
            raise _Corrupt(f"a string at byte {pos} runs past the end of the file")
        return self._map[pos + 8 : end].decode("utf-8"), end

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                width = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._map, pos))
                return values, pos + count * width
            values = []
            for _ in range(count):
                value, pos = self._value(etype, pos)
                values.append(value)
            return values, pos
        raise _Corrupt(f"unknown metadata value type {vtype} at byte {pos}")

    def read(self, info: GGUFTensorInfo) -> np.ndarray:
        """Dequantize one tensor.

        Returns:
            A new float32 array of ``info.shape`` (writable, not backed by the file).
        """
        raw = self._array[info.start : info.start + info.nbytes]
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        rows = raw.reshape(-1, info.shape[-1] // block * type_size) if info.shape else raw
        out = dequantize(rows, info.ggml_type)
        if out.dtype != np.float32 or np.shares_memory(out, self._array):
            out = np.array(out, dtype=np.float32)
        return out.reshape(info.shape)

    def raw_rows(self, info: GGUFTensorInfo, rows: tuple[int, int]) -> np.ndarray:
        """Rows ``rows[0]:rows[1]`` of a tensor seen as 2-D, as stored: a read-only uint8 view
        ``[rows[1] - rows[0], row bytes]`` of the mapped file (quantization blocks run along a
        row, so rows are independent)."""
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        width = info.shape[-1] if info.shape else 1
        row_bytes = width // block * type_size
        return self._array[info.start : info.start + info.nbytes].reshape(-1, row_bytes)[
            rows[0] : rows[1]
        ]

    def read_region(
        self, info: GGUFTensorInfo, rows: tuple[int, int], cols: tuple[int, int]
    ) -> np.ndarray:
        """Dequantize rows ``rows[0]:rows[1]``, columns ``cols[0]:cols[1]`` of a tensor seen as 2-D.

        The tensor is viewed as ``[prod(shape[:-1]), shape[-1]]`` (a 1-D tensor is one row).
        Only the bytes of those rows are read; of each row, only the quantization blocks
        covering the columns when the column range is block-aligned, else the whole row.

        Returns:
            A new float32 array ``[rows[1] - rows[0], cols[1] - cols[0]]``.
        """
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        width = info.shape[-1] if info.shape else 1
        raw = self.raw_rows(info, rows)
        start, stop = cols
        if start % block == 0 and (stop % block == 0 or stop == width):
            raw = raw[:, start // block * type_size : -(-stop // block) * type_size]
            start, stop = 0, stop - start
        out = dequantize(np.ascontiguousarray(raw), info.ggml_type).reshape(rows[1] - rows[0], -1)[
            :, start:stop
        ]
        if out.dtype != np.float32 or np.shares_memory(out, self._array):
            out = np.array(out, dtype=np.float32)
        return np.ascontiguousarray(out)


def _corrupt_message(path: Path, detail: str) -> str:
    return f"{path} is truncated or corrupt ({detail}); re-download it."


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed :class:`GGUFFile` at ``path``, cached while its size and mtime are unchanged.

    Raises:
        ModelLoadError: the file is missing or not a readable GGUF file.
    """
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"GGUF file {path} cannot be read ({e.strerror}).") from e
    return _open_cached(str(path), stat.st_size, stat.st_mtime_ns)
