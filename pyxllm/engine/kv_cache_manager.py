"""The KV block manager: which cache blocks each request owns."""
from __future__ import annotations

from collections import deque

from pyxllm.engine.request import Request


class KVCacheManager:
    """Hands out fixed-size KV blocks (``block_size`` tokens each) from a pool of ``num_blocks``.

    A request owns a block table (list of block ids) covering its computed tokens plus those
    scheduled this step; ``free`` returns them all.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request``'s block table to cover ``num_new_tokens`` more tokens.

        Returns False, allocating nothing, when too few blocks are free.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > len(self.free_block_ids):
            return False
        table.extend(self.free_block_ids.popleft() for _ in range(max(needed, 0)))
        return True

    def get_block_table(self, request: Request) -> list[int]:
        return self.block_tables[request.request_id]

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool (no-op if it holds none)."""
        self.free_block_ids.extend(self.block_tables.pop(request.request_id, ()))
