"""A KV cache tier on disk that outlives the process (``--kv-offload-dir``).

Every full KV block the prefix cache registers is also written to a file named by its block
hash, which chains the hashes of every block before it (``block_pool.hash_block_tokens``), so a
file stands for a whole prefix. Before scheduling, a waiting request's leading blocks that the
RAM prefix cache lacks but the directory holds are read back into free blocks and registered in
the RAM cache; the scheduler then counts them as ordinary prefix-cache hits (and
``cached_tokens`` reports them). So a restarted server, or another data-parallel replica on the
same directory, skips the prefill of a prompt prefix computed before. vLLM's KV connectors and
LMCache, SGLang's HiCache and llama.cpp's ``--slot-save-path`` do the same at other levels.

Files live under a subdirectory named by a digest of what makes KV bytes mean the same thing
(the model, its weights' format, the dtypes, the block size, the tensor-parallel layout, the
block's byte size): another model's blocks are never read. Each file is a header (magic,
payload length, SHA-256 of the payload) and the payload (every layer's K then V rows of the
block, as the cache holds them); a torn, truncated or foreign file fails the check and counts
as a miss, never as wrong KV. Writes go to a temporary file renamed into place (atomic on
POSIX), so readers never see a half-written block, and two engines writing the same block
both leave one whole file. The directory keeps at most ``max_bytes``: the least recently used
files (by modification time, refreshed on each read) are deleted first. Several engines may
share the directory (data-parallel replicas, prefill and decode instances): each counts what it
writes and measures the directory again whenever it has written an eighth of ``max_bytes``
since it last did, so together they overshoot by at most an eighth each; a file another engine
deletes meanwhile is simply a miss.

The engine reads and writes blocks on threads of their own, so a step never waits for the
disk (``pyxllm.engine.kv_connector``); a block of the embedded model is 0.37 MB in bfloat16.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PYXLLMKV1"
_HEADER = struct.Struct(f"<{len(MAGIC)}sQ32s")  # magic, payload bytes, SHA-256 of the payload


class DiskKVTier:
    """Block files in ``directory``/``digest(identity)`` (see the module docstring).

    Args:
        directory: the tier's root (created if missing); several engines may share it.
        max_bytes: the most bytes its files for this identity may take.
        identity: what the KV bytes depend on, as text.
        block_bytes: the payload of one block, bytes.

    Attributes:
        hits, bytes_read: blocks and payload bytes read back, since start.
        blocks_written, bytes_written: blocks and payload bytes written, since start.
        rejected: files that failed their check (deleted), since start.
    """

    def __init__(self, directory: str, max_bytes: int, identity: str, block_bytes: int) -> None:
        digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.root = Path(directory).expanduser() / digest
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.block_bytes = max_bytes, block_bytes
        self.hits = self.bytes_read = self.blocks_written = self.bytes_written = 0
        self.rejected = 0
        self._size = sum(size for _, _, size in self._files())
        self._unmeasured = 0  # bytes written since the directory was last measured

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}.kv"

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file for ``block_hash`` exists (it may still fail its check)."""
        return self._path(block_hash).is_file()

    def load(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or ``None`` when the file is missing, torn or foreign (such a
        file is deleted)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) >= _HEADER.size:
            magic, length, checksum = _HEADER.unpack_from(data)
            payload = data[_HEADER.size :]
            if (
                magic == MAGIC
                and length == len(payload) == self.block_bytes
                and hashlib.sha256(payload).digest() == checksum
            ):
                try:
                    os.utime(path)  # least recently used goes first
                except OSError:  # another engine evicted it meanwhile: the bytes are whole
                    pass
                self.hits += 1
                self.bytes_read += len(payload)
                return payload
        logger.warning("KV tier: %s fails its check; deleted", path)
        self.rejected += 1
        path.unlink(missing_ok=True)
        return None

    def save(self, block_hash: bytes, payload: bytes) -> None:
        """Write the block's file (unless it exists), then delete the least recently used
        files beyond ``max_bytes``."""
        path = self._path(block_hash)
        if path.is_file():
            return
        header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        except OSError as exc:
            logger.warning("KV tier: cannot write %s: %s", path, exc)
            return
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            logger.warning("KV tier: cannot write %s: %s", path, exc)
            return
        self.blocks_written += 1
        self.bytes_written += len(payload)
        self._size += _HEADER.size + len(payload)
        self._unmeasured += _HEADER.size + len(payload)
        if self._size > self.max_bytes or self._unmeasured > self.max_bytes // 8:
            self._evict()

    def _files(self) -> list[tuple[float, Path, int]]:
        """``(modification time, path, size)`` of each block file now in the directory (one
        deleted while listing is left out)."""
        files = []
        for path in self.root.glob("*/*.kv"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, path, stat.st_size))
        return files

    def _evict(self) -> None:
        """Measure the directory, then delete its least recently used files beyond
        ``max_bytes``."""
        files = sorted(self._files())
        self._size, self._unmeasured = sum(size for _, _, size in files), 0
        for _, path, size in files:
            if self._size <= self.max_bytes:
                return
            path.unlink(missing_ok=True)
            self._size -= size
