"""The block pool and KV cache manager on their own: hashes, hits, ref counts, LRU eviction."""

from __future__ import annotations

from pyxllm.config import EngineConfig
from pyxllm.engine.block_pool import BlockPool, hash_block_tokens
from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.request import Request
from pyxllm.engine.scheduler import Scheduler
from pyxllm.sampling_params import SamplingParams

BS = 4  # tokens per block in these tests


def make_request(rid: str, token_ids: list[int]) -> Request:
    params = SamplingParams(temperature=0, max_tokens=16)
    return Request(rid, None, list(token_ids), params, detokenizer=None)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admit ``request`` the way the scheduler does (whole prompt in one step); returns its hit in
    tokens."""
    hits = kv.get_computed_blocks(request)
    cached = len(hits) * kv.block_size
    assert kv.allocate_slots(request, request.num_tokens - cached, hits)
    request.num_computed_tokens = request.num_tokens
    return cached


def test_block_hash_chains_parent_and_tokens():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    child = hash_block_tokens(first, [5, 6, 7, 8])
    assert child != hash_block_tokens(None, [5, 6, 7, 8])
    assert child != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])


def test_identical_prefix_hits_the_same_blocks():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == 0
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == 8
    assert kv.get_block_table(b)[:2] == kv.get_block_table(a)[:2]
    assert kv.get_block_table(b)[2] != kv.get_block_table(a)[2]
    assert (kv.num_queries, kv.num_hits) == (10 + 11, 8)
    assert [blk.ref_cnt for blk in kv.tables["a"]] == [2, 2, 1]


def test_no_hit_when_an_earlier_block_differs():
    kv = KVCacheManager(16, BS)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # block 1 has the same tokens, but its parent differs: the chained hash misses
    assert admit(kv, make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    assert admit(kv, make_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])) == 4


def test_ref_counts_and_used_blocks():
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(kv, a)
    assert kv.num_used_blocks == 3
    assert admit(kv, b) == 8
    assert kv.num_used_blocks == 4  # two shared blocks, one tail block each
    kv.free(a)
    assert kv.num_used_blocks == 3
    assert [blk.ref_cnt for blk in kv.tables["b"]] == [1, 1, 1]
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.usage == 0.0
    assert kv.num_free_blocks == 8
    # freed blocks keep their contents: a new request still hits them
    c = make_request("c", list(range(9)))
    assert admit(kv, c) == 8
    assert kv.num_used_blocks == 3


def test_lru_evicts_empty_blocks_then_tail_blocks_first():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(13)))  # blocks a0 a1 a2 full, a3 partial
    admit(kv, a)
    a_table = kv.get_block_table(a)
    kv.free(a)
    # b needs two blocks: the partial (never cached) a3 goes first, then a's tail block a2
    b = make_request("b", [100 + i for i in range(5)])
    admit(kv, b)
    assert set(kv.get_block_table(b)) == {a_table[3], a_table[2]}
    kv.free(b)
    hits = kv.get_computed_blocks(make_request("c", list(range(13))))
    assert [blk.block_id for blk in hits] == a_table[:2]  # a0 and a1 survive


def test_lru_evicts_least_recently_freed_request_first():
    kv = KVCacheManager(4, BS)
    old, new = make_request("old", [1, 2, 3, 4, 5]), make_request("new", [6, 7, 8, 9, 10])
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    admit(kv, make_request("x", [20, 21, 22, 23, 24]))  # two blocks: the two partial ones
    admit(kv, make_request("y", [30]))  # one more: old's cached block goes first
    assert kv.get_computed_blocks(make_request("old2", [1, 2, 3, 4, 5])) == []
    assert len(kv.get_computed_blocks(make_request("new2", [6, 7, 8, 9, 10]))) == 1


def test_fully_cached_prompt_recomputes_at_least_its_last_token():
    kv = KVCacheManager(16, BS)
    admit(kv, make_request("a", list(range(8))))
    # block-aligned and 100 % cached: the last block is recomputed (never written in place)
    aligned = make_request("b", list(range(8)))
    hits = kv.get_computed_blocks(aligned)
    assert len(hits) * BS == 4
    # one token past a block boundary: everything but that token is a hit
    admit(kv, make_request("c", list(range(9))))
    assert len(kv.get_computed_blocks(make_request("d", list(range(9))))) * BS == 8


def test_hit_check_compares_token_ids_not_only_hashes():
    kv = KVCacheManager(16, BS, hash_fn=lambda parent, tokens: b"collide")
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert admit(kv, make_request("b", [9, 9, 9, 9, 5])) == 0  # same hash, other tokens
    assert admit(kv, make_request("c", [1, 2, 3, 4, 7])) == 4


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    big = make_request("big", list(range(8)) + list(range(100, 105)))  # hits 2 blocks, needs 2 more
    hits = kv.get_computed_blocks(big)
    assert len(hits) == 2
    assert not kv.allocate_slots(big, big.num_tokens - 8, hits)
    assert kv.num_free_blocks == 3 and kv.num_used_blocks == 0
    assert all(blk.ref_cnt == 0 for blk in hits) and "big" not in kv.tables
    assert (kv.num_queries, kv.num_hits) == (9, 0)


def test_prefix_cache_off_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_cache=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert admit(kv, make_request("b", list(range(9)))) == 0
    assert not kv.pool.cached and kv.num_queries == 0


def test_pool_rejects_taking_more_blocks_than_free():
    pool = BlockPool(2)
    pool.get_new_blocks(2)
    try:
        pool.get_new_blocks(1)
    except ValueError as e:
        assert "only 0 are free" in str(e)
    else:
        raise AssertionError("expected ValueError")


def run_until_done(
    scheduler: Scheduler, requests: list[Request], target_len: int
) -> list[tuple[str, int]]:
    """Drive the scheduler with fake sampled tokens until every request has ``target_len`` tokens.

    Returns ``(request_id, num_computed_tokens)`` of every scheduled sequence, in order.
    """
    seen = []
    for step in range(500):
        plan = scheduler.schedule()
        seen += [(s.request_id, s.num_computed_tokens) for s in plan.sequences]
        tokens = [[1000 + step] if s.sample else [] for s in plan.sequences]
        scheduler.update_from_output(tokens)
        for r in list(scheduler.running):
            if r.num_tokens >= target_len:
                scheduler.finish_request(r, r.status.FINISHED_LENGTH)
        if all(r.status.finished for r in requests):
            return seen
    raise AssertionError("scheduler made no progress")


def test_preempted_request_looks_up_hits_again():
    config = EngineConfig(block_size=BS, max_tokens_per_batch=64, max_seqs_per_batch=8)
    kv = KVCacheManager(9, BS)
    scheduler = Scheduler(config, kv)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(50, 60)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    seen = run_until_done(scheduler, [a, b], 20)
    assert scheduler.num_preemptions >= 1
    b_starts = [n for rid, n in seen if rid == "b"]
    drops = [(before, after) for before, after in zip(b_starts, b_starts[1:]) if after <= before]
    assert drops, "b was never preempted"
    # b came back starting after a block-aligned cache hit of its own blocks, not from 0
    assert all(after > 0 and after % BS == 0 for _, after in drops)
    assert kv.num_hits >= sum(after for _, after in drops)
    assert b.num_tokens == 20 and kv.num_used_blocks == 0
