"""Which data-parallel replica serves a request (``--dp-routing``); pure Python, no I/O.

- ``round_robin``: the live replicas in turn.
- ``least_loaded``: the replica with the fewest unfinished requests the router sent it (its
  running plus waiting ones; a request with ``n`` samples counts ``n``), ties to the one sent
  the fewest requests so far, then the lowest index.
- ``cache_aware`` (SGLang's router): the replica whose prefix cache holds the longest prefix of
  the prompt, when that prefix is at least :data:`CACHE_MATCH_RATIO` of the prompt; otherwise,
  or when that replica's load runs far ahead of the least loaded one's (more than
  ``balance_abs`` requests more *and* more than ``balance_rel`` times as many: SGLang's
  imbalance rule), the least loaded replica, ties to the one caching the least.

The router does not ask the replicas what they cache: as SGLang's cache-aware router keeps an
approximate radix tree of the text it sent each worker, this one keeps, per replica, a
:class:`PrefixIndex` of the prompts' full KV blocks it sent there, hashed as the engine's
prefix cache hashes them (:func:`~pyxllm.engine.block_pool.hash_block_tokens`: a block's hash
chains its parent's), bounded to the replica's KV cache size with least-recently-used eviction,
as the replica's cache evicts. Prefixes match at block granularity, as the cache reuses them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pyxllm.engine.block_pool import BlockHash, hash_block_tokens

ROUTING_POLICIES = ("cache_aware", "least_loaded", "round_robin")
# the cached part of a prompt that makes cache_aware prefer the replica holding it (SGLang's
# router's cache threshold as the issue gives it)
CACHE_MATCH_RATIO = 0.3
# cache_aware leaves the cached replica for the least loaded one when its load exceeds the least
# loaded one's by more than this many requests and by more than this factor (SGLang's rule)
BALANCE_ABS_THRESHOLD = 16
BALANCE_REL_THRESHOLD = 1.5


class NoReplicaError(RuntimeError):
    """Every replica has been taken out of rotation."""


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks of ``block_size`` tokens (a partial last
    block has none: the prefix cache keeps only full blocks)."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The block hashes one replica was sent, newest last, at most ``capacity`` of them.

    Since a hash chains its parents, a prompt's cached prefix is its longest run of leading
    hashes found here.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``' leading blocks are held."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Record a prompt's blocks as the most recently used, evicting the least recently used
        ones beyond ``capacity`` (a prompt's tail before its head, as the engine evicts)."""
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        """Forget every block."""
        self._blocks.clear()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes and why.

    Attributes:
        replica: the replica's index.
        reason: ``"prefix"`` (its cache holds enough of the prompt), ``"least_loaded"``,
            ``"rebalance"`` (the cached replica was too far ahead) or ``"round_robin"``.
        matched_tokens: the prompt tokens the chosen replica is expected to hold (whole
            blocks; 0 unless ``cache_aware``).
    """

    replica: int
    reason: str
    matched_tokens: int = 0


class Router:
    """Chooses a replica per request and tracks each replica's load (thread-safe).

    Args:
        num_replicas: replicas ``0 .. num_replicas - 1``, all in rotation at first.
        policy: one of :data:`ROUTING_POLICIES`.
        block_size: the engines' KV block size, in tokens.
        cache_blocks: each replica's KV cache size, in blocks (the prefix index's bound).
        match_ratio, balance_abs, balance_rel: see the module doc.

    Raises:
        ValueError: an unknown policy or a size below 1 (naming the flag).
    """

    def __init__(
        self,
        num_replicas: int,
        policy: str = "cache_aware",
        block_size: int = 16,
        cache_blocks: int = 1024,
        match_ratio: float = CACHE_MATCH_RATIO,
        balance_abs: int = BALANCE_ABS_THRESHOLD,
        balance_rel: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"--dp-routing: must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}"
            )
        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size: must be >= 1, got {num_replicas}")
        self.policy, self.block_size = policy, block_size
        self.match_ratio, self.balance_abs, self.balance_rel = match_ratio, balance_abs, balance_rel
        self.loads = [0] * num_replicas
        self.num_routed = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.indexes = [PrefixIndex(cache_blocks) for _ in range(num_replicas)]
        self._next = 0  # round_robin's next replica
        self._lock = threading.Lock()

    def route(self, prompt_token_ids: Sequence[int], weight: int = 1) -> RouteDecision:
        """Choose the replica for a prompt and count ``weight`` (its ``n``) on its load until
        :meth:`release`.

        Raises:
            NoReplicaError: no replica is left in rotation.
        """
        with self._lock:
            live = [i for i, alive in enumerate(self.alive) if alive]
            if not live:
                raise NoReplicaError("no data-parallel replica is left")
            if self.policy == "round_robin":
                decision = self._round_robin(live)
            elif self.policy == "least_loaded":
                decision = RouteDecision(self._least_loaded(live), "least_loaded")
            else:
                decision = self._cache_aware(live, prompt_token_ids)
            self.loads[decision.replica] += weight
            self.num_routed[decision.replica] += 1
            return decision

    def release(self, replica: int, weight: int = 1) -> None:
        """A request sent to ``replica`` finished, failed or was aborted."""
        with self._lock:
            self.loads[replica] = max(0, self.loads[replica] - weight)

    def remove(self, replica: int) -> None:
        """Take ``replica`` out of rotation for good (it died); forget what it cached."""
        with self._lock:
            self.alive[replica] = False
            self.loads[replica] = 0
            self.indexes[replica].clear()

    def _round_robin(self, live: list[int]) -> RouteDecision:
        n = len(self.alive)
        for step in range(n):
            candidate = (self._next + step) % n
            if self.alive[candidate]:
                self._next = (candidate + 1) % n
                return RouteDecision(candidate, "round_robin")
        raise AssertionError(f"no live replica among {live}")  # route() checked there is one

    def _least_loaded(self, live: list[int], by_cache_size: bool = False) -> int:
        def key(i: int) -> tuple:
            room = len(self.indexes[i]) if by_cache_size else 0
            return self.loads[i], room, self.num_routed[i], i

        return min(live, key=key)

    def _imbalanced(self, replica: int, live: list[int]) -> bool:
        """Whether ``replica``'s load runs far ahead of the least loaded live replica's."""
        least = min(self.loads[i] for i in live)
        load = self.loads[replica]
        return load - least > self.balance_abs and load > self.balance_rel * least

    def _cache_aware(self, live: list[int], prompt_token_ids: Sequence[int]) -> RouteDecision:
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        matched = {i: self.indexes[i].match(hashes) for i in live}
        best = max(live, key=lambda i: (matched[i], -self.loads[i], -i))
        tokens = matched[best] * self.block_size
        cached = tokens > 0 and tokens >= self.match_ratio * len(prompt_token_ids)
        if cached and not self._imbalanced(best, live):
            decision = RouteDecision(best, "prefix", tokens)
        else:
            chosen = self._least_loaded(live, by_cache_size=True)
            reason = "rebalance" if cached else "least_loaded"
            decision = RouteDecision(chosen, reason, matched[chosen] * self.block_size)
        self.indexes[decision.replica].insert(hashes)
        return decision
