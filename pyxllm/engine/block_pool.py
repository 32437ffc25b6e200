"""The pool of KV cache blocks: ref counts, block hashes, and LRU eviction of cached free blocks.

A full block is identified by a hash chaining its parent block's hash with its own token ids
(:func:`hash_block_tokens`), so equal hashes mean equal prefixes up to that block. A block whose
last reference is dropped keeps its K/V and its hash: it is *free* (may be handed out again) but
still *cached* (a later request with the same prefix can take it back) until it is evicted.

Free blocks wait in one queue, evicted from the front: blocks that hold nothing reusable (never
hashed) go to the front, cached blocks to the back in least-recently-freed order. A request frees
its blocks tail first, so of one request's blocks the last ones are evicted first and the shared
head of a prompt lives longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
# ``(parent hash, token ids[, extra keys]) -> hash``, see :func:`hash_block_tokens`
HashFn = Callable[..., BlockHash]


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """The SHA-256 digest of ``parent_hash`` (``None`` for a prompt's first block), the block's
    token ids and ``extra_keys`` (the content hashes of the images whose placeholder tokens
    the block holds, see ``Request.block_extra_keys``: same tokens, other image, other hash)."""
    digest = hashlib.sha256(parent_hash or b"\0")
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(extra_keys)
    return digest.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV cache block.

    Attributes:
        block_id: index into the per-layer cache tensors.
        ref_cnt: running requests whose block table holds it; 0 means free.
        block_hash / token_ids: set while the block is cached (full, and registered under its hash).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """``num_blocks`` blocks, handed out by reference count, cached under their hashes.

    With ``enable_caching`` off, no block is ever registered, so freed blocks are simply reused.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[BlockHash, KVBlock] = {}
        # when a list (a KV tier is on), the blocks registered since it was last emptied
        self.newly_cached: list[KVBlock] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for ``block_hash`` if it holds exactly ``token_ids``, else ``None``."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take one more reference on each of ``blocks`` (cache hits), taking free ones off the
        queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks, evicting their cached contents; each gets ref count 1.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > len(self.free_queue):
            raise ValueError(
                f"asked for {num_blocks} KV blocks, only {len(self.free_queue)} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = block.token_ids = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full block under ``block_hash``; a no-op when caching is off, the block is
        already registered, or another block holds that hash (the first one stays cached)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.cached[block_hash] = block
        if self.newly_cached is not None:
            self.newly_cached.append(block)

    def free_blocks(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each of ``blocks``, in the given order (pass a table reversed so
        its tail is evicted first); a block left unreferenced joins the free queue."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def reset_cache(self) -> int:
        """Forget every cached free block (blocks in use keep their hashes); returns how many."""
        dropped = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = block.token_ids = None
                dropped += 1
        return dropped
