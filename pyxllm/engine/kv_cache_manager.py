"""The KV block manager: which cache blocks each request owns, and prefix-cache hits.

Prefix caching follows vLLM v1: a waiting request (new, or back from preemption) looks up the
longest run of its leading *full* blocks already cached (:meth:`KVCacheManager.get_computed_blocks`)
and starts computing after them. Hits are whole blocks and never cover the last token, which
must be recomputed to get its logits: a fully cached, block-aligned prompt recomputes its whole
last block rather than writing into a block other requests share. A block is registered in the
cache as soon as the step that fills it is scheduled (its K/V are written in that forward pass,
before any attention reads them), so requests admitted later in the same step already hit it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyxllm.engine.block_pool import BlockPool, HashFn, KVBlock, hash_block_tokens
from pyxllm.engine.request import Request


@dataclass(slots=True, eq=False)
class TierLoad:
    """A read of a request's prefix blocks from a KV tier in progress
    (:meth:`KVCacheManager.begin_tier_load`).

    Attributes:
        request: whose blocks they are.
        hits: its RAM prefix-cache hits, referenced until the load ends.
        blocks / hashes: the free blocks taken for the tier's blocks, and their hashes, in
            prompt order, starting with its block ``first`` (``len(hits)``).
    """

    request: Request
    hits: list[KVBlock]
    blocks: list[KVBlock]
    hashes: list[bytes]
    first: int


class KVCacheManager:
    """Hands out fixed-size KV blocks (``block_size`` tokens each) from a pool of ``num_blocks``.

    A request owns a block table covering its computed tokens plus those scheduled this step;
    ``free`` drops its references. With ``enable_prefix_cache``, full blocks stay cached after
    they are freed until evicted (see :mod:`pyxllm.engine.block_pool`).

    Attributes:
        num_queries / num_hits: prefix-cache lookups, in tokens: the tokens of each admitted
            request, and those of them found cached (counted when the admission succeeds).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(num_blocks, enable_prefix_cache)
        self.hash_fn = hash_fn
        self.tables: dict[str, list[KVBlock]] = {}
        self.block_ids: dict[str, list[int]] = {}  # the same tables as block ids, for the executor
        self.num_cached_blocks: dict[
            str, int
        ] = {}  # leading table blocks already offered to the cache
        self.num_queries = self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request references (cached free blocks included)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live requests (a cached free block is not used)."""
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return self.pool.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """``request.block_hashes`` extended to its first ``num_full_blocks`` full blocks."""
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else request.prefix_cache_salt
            tokens = request.token_ids[i * size : (i + 1) * size]
            extra = request.block_extra_keys(i * size, (i + 1) * size)
            hashes.append(
                self.hash_fn(parent, tokens, extra) if extra else self.hash_fn(parent, tokens)
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The cached blocks matching ``request``'s leading full blocks (its prefix-cache hit).

        Stops at the first block not cached (or cached with other token ids), and never covers
        the request's last token. Takes no reference: pass the result to :meth:`allocate_slots`
        in the same scheduling step. Empty when the prefix cache is off.
        """
        if not self.enable_prefix_cache:
            return []
        size = self.block_size
        max_blocks = (request.num_tokens - 1) // size
        hits = []
        for i, block_hash in enumerate(self._block_hashes(request, max_blocks)):
            block = self.pool.get_cached_block(
                block_hash, request.token_ids[i * size : (i + 1) * size]
            )
            if block is None:
                break
            hits.append(block)
        return hits

    def tier_block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of ``request``'s leading full blocks that a KV tier could fill: every
        full block but one holding its last token (whose logits are needed)."""
        return list(self._block_hashes(request, (request.num_tokens - 1) // self.block_size))

    def begin_tier_load(self, request: Request, contains) -> TierLoad | None:
        """Start filling the RAM prefix cache with ``request``'s leading full blocks that it
        lacks and a KV tier holds (``contains(block_hash)``): takes a free block for each (at
        most half the free blocks) and a reference on the request's RAM hits, so neither is
        evicted while the tier is read. ``None`` when there is nothing to read. Pass the result
        to :meth:`finish_tier_load` (or :meth:`cancel_tier_load`)."""
        if not self.enable_prefix_cache:
            return None
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.get_computed_blocks(request)
        hashes = self._block_hashes(request, max_blocks)
        wanted = []
        for i in range(len(hits), max_blocks):
            if not contains(hashes[i]):
                break
            wanted.append(i)
        if not wanted:
            return None
        self.pool.touch(hits)  # the RAM hits stay while free blocks are taken
        count = min(len(wanted), self.pool.num_free_blocks // 2)
        if count == 0:
            self.pool.free_blocks(hits[::-1])
            return None
        blocks = self.pool.get_new_blocks(count)
        return TierLoad(request, hits, blocks, [hashes[i] for i in wanted[:count]], len(hits))

    def finish_tier_load(self, load: TierLoad, payloads: list, write_block) -> int:
        """Write the blocks read for ``load`` (``payloads[i]``: block ``i``'s bytes, ``None``
        for a miss, which ends the run) into its blocks with ``write_block(block_id,
        payload)``, register them as cached free blocks (the next :meth:`get_computed_blocks`
        counts them as hits) and drop the load's references; returns how many it loaded."""
        size, tokens = self.block_size, load.request.token_ids
        saved, self.pool.newly_cached = self.pool.newly_cached, None  # on disk already
        loaded = 0
        for block, block_hash, payload in zip(load.blocks, load.hashes, payloads):
            if payload is None:
                break
            i = load.first + loaded
            write_block(block.block_id, payload)
            self.pool.cache_block(block, block_hash, tokens[i * size : (i + 1) * size])
            loaded += 1
        self.pool.newly_cached = saved
        self.cancel_tier_load(load)
        return loaded

    def cancel_tier_load(self, load: TierLoad) -> None:
        """Drop ``load``'s references (its blocks not yet registered are plain free blocks)."""
        self.pool.free_blocks(load.blocks[::-1])
        self.pool.free_blocks(load.hits[::-1])

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        num_draft_tokens: int = 0,
    ) -> bool:
        """Grow ``request``'s block table to cover ``num_new_tokens`` more tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`; given, possibly empty, only when
        admitting a request with no table) are taken first and count as computed: the new
        tokens start after them, and the admission counts in ``num_queries``/``num_hits``.
        Full blocks up to the new end are registered in the prefix cache, except where the last
        ``num_draft_tokens`` of the new tokens (speculative drafts, which the step may reject)
        fall: a block is registered only once every token in it is the request's.

        Returns False, changing nothing, when too few blocks are free.
        """
        rid, hits = request.request_id, computed_blocks or []
        table = self.tables.get(rid, [])
        end = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = self.blocks_for_tokens(end) - len(table) - len(hits)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        new_blocks = hits + self.pool.get_new_blocks(max(num_needed, 0))
        self.tables.setdefault(rid, table).extend(new_blocks)
        self.block_ids.setdefault(rid, []).extend(b.block_id for b in new_blocks)
        if computed_blocks is not None and self.enable_prefix_cache:
            self.num_queries += request.num_tokens
            self.num_hits += len(hits) * self.block_size
            self.num_cached_blocks[rid] = len(hits)
        self._cache_full_blocks(request, table, (end - num_draft_tokens) // self.block_size)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks at the tail of ``request``'s table past its first ``num_tokens``
        tokens (those allocated for speculative drafts the step rejected); they were never
        registered in the prefix cache."""
        rid = request.request_id
        keep = self.blocks_for_tokens(num_tokens)
        table = self.tables.get(rid, [])
        if len(table) > keep:
            self.pool.free_blocks(table[keep:][::-1])
            del table[keep:]
            del self.block_ids[rid][keep:]

    def _cache_full_blocks(
        self, request: Request, table: list[KVBlock], num_full_blocks: int
    ) -> None:
        """Offer ``request``'s full blocks not offered yet to the cache (duplicates stay
        uncached)."""
        if not self.enable_prefix_cache:
            return
        size, start = self.block_size, self.num_cached_blocks.get(request.request_id, 0)
        hashes = self._block_hashes(request, num_full_blocks)
        for i in range(start, num_full_blocks):
            self.pool.cache_block(table[i], hashes[i], request.token_ids[i * size : (i + 1) * size])
        self.num_cached_blocks[request.request_id] = max(start, num_full_blocks)

    def get_block_table(self, request: Request) -> list[int]:
        """The block ids of ``request``'s table, in token order."""
        return self.block_ids[request.request_id]

    def free(self, request: Request) -> None:
        """Drop ``request``'s references to its blocks, tail first (no-op if it holds none)."""
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_ids.pop(request.request_id, None)
        self.pool.free_blocks(self.tables.pop(request.request_id, [])[::-1])

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no request uses; returns how many were dropped."""
        return self.pool.reset_cache()
