"""``--kv-offload-dir``: full KV blocks written to files and read back for a prompt prefix the
RAM prefix cache lacks, across engines (a restart) on the same directory; the answers are the
same bits as without the tier (batch invariance), and a damaged or foreign file is a miss."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyxllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [(i * 37) % 40000 + 100 for i in range(100)]}  # 6 full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
KWARGS = dict(max_model_len=256, kv_cache_memory=0.1)


def _metrics(llm: LLM) -> dict[tuple[str, str | None], float]:
    """The engine's Prometheus samples, as ``/metrics`` renders them: ``(name,
    transfer_type label) -> value``."""
    text = generate_latest(llm.llm_engine.metrics.registry).decode()
    return {
        (sample.name, sample.labels.get("transfer_type")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _answer(llm: LLM):
    """The prompt's tokens, log-probabilities and prompt tokens served from a cache."""
    out = llm.generate([PROMPT], GREEDY)[0]
    sample = out.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in top.items()} for top in sample.logprobs]
    return sample.token_ids, logprobs, out.num_cached_tokens


@pytest.fixture(scope="module")
def reference():
    tokens, logprobs, cached = _answer(LLM(**KWARGS))
    assert cached == 0
    return tokens, logprobs


def test_a_new_engine_reads_the_prefix_a_former_one_wrote(tmp_path, reference):
    first = LLM(kv_offload_dir=str(tmp_path), **KWARGS)
    tokens, logprobs, cached = _answer(first)
    assert (tokens, logprobs) == reference and cached == 0
    stats = first.llm_engine.stats()
    assert stats["kv_tier_bytes_written"] > 0 and stats["kv_tier_hits"] == 0
    assert _metrics(first)[("pyxllm:kv_offload_blocks_total", "CPU_to_DISK")] >= 6
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert len(files) >= 6
    del first
    second = LLM(kv_offload_dir=str(tmp_path), **KWARGS)  # a restart: its RAM cache is empty
    tokens, logprobs, cached = _answer(second)
    assert (tokens, logprobs) == reference
    assert cached == 96  # the 6 blocks of 16 tokens before the prompt's last token
    stats = second.llm_engine.stats()
    assert stats["kv_tier_hits"] == 6 and stats["kv_tier_blocks_written"] == 0
    block = second.llm_engine.kv_connector.tier.block_bytes
    metrics = _metrics(second)
    assert metrics[("vllm:external_prefix_cache_queries_total", None)] == 100
    assert metrics[("vllm:external_prefix_cache_hits_total", None)] == 96
    assert metrics[("vllm:kv_offload_total_bytes_total", "DISK_to_CPU")] == 6 * block
    assert metrics[("vllm:kv_offload_total_bytes_total", "CPU_to_DISK")] == 0
    assert metrics[("pyxllm:kv_offload_blocks_total", "DISK_to_CPU")] == 6
    assert metrics[("pyxllm:kv_offload_rejected_blocks_total", None)] == 0
    # a torn file is a miss, deleted, never wrong KV
    files[0].write_bytes(files[0].read_bytes()[:-10])
    third = LLM(kv_offload_dir=str(tmp_path), **KWARGS)
    tokens, logprobs, cached = _answer(third)
    assert (tokens, logprobs) == reference and cached < 96
    metrics = _metrics(third)
    assert metrics[("pyxllm:kv_offload_rejected_blocks_total", None)] == 1
    assert metrics[("vllm:external_prefix_cache_hits_total", None)] == cached
    # the blocks after the torn one are not read: a prefix stops at its first missing block
    assert metrics[("pyxllm:kv_offload_blocks_total", "DISK_to_CPU")] == cached // 16
    # computed again, the torn block alone is written again (the others are on disk)
    assert metrics[("pyxllm:kv_offload_blocks_total", "CPU_to_DISK")] == 1


def test_another_models_blocks_are_never_read(tmp_path):
    LLM(kv_offload_dir=str(tmp_path), **KWARGS).generate([PROMPT], GREEDY)
    other = LLM(kv_offload_dir=str(tmp_path), block_size=32, **KWARGS)
    _, _, cached = _answer(other)
    assert cached == 0 and other.llm_engine.stats()["kv_tier_hits"] == 0
    assert len({p.parent.parent for p in tmp_path.glob("*/*/*.kv")}) == 2


def test_the_directory_keeps_its_budget(tmp_path):
    llm = LLM(kv_offload_dir=str(tmp_path), kv_offload_max_gib=3e-3, **KWARGS)
    block = llm.llm_engine.kv_connector.tier.block_bytes
    llm.generate([PROMPT], GREEDY)
    total = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kv"))
    assert 0 < total <= 3e-3 * 2**30 and total // block < 6


def test_the_tier_needs_a_one_rank_generating_engine_with_the_prefix_cache(tmp_path):
    with pytest.raises(ValueError, match="--enable-prefix-cache: not with --kv-offload-dir"):
        LLM(kv_offload_dir=str(tmp_path), enable_prefix_cache=False)
    with pytest.raises(ValueError, match="--kv-offload-max-gib"):
        LLM(kv_offload_dir=str(tmp_path), kv_offload_max_gib=0)
    with pytest.raises(ValueError, match="--kv-role decode: needs --kv-offload-dir"):
        LLM(kv_role="decode")


def test_engines_sharing_a_directory_keep_its_budget_together(tmp_path):
    """Two tiers on one directory (two replicas) each write blocks: the directory stays within
    the budget plus the eighth each may write before measuring it again; a block one deletes
    is a plain miss for the other, and a block both write is one whole file."""
    from pyxllm.engine.kv_offload import _HEADER, DiskKVTier

    block, budget = 1000, 40 * (1000 + _HEADER.size)
    tiers = [DiskKVTier(str(tmp_path), budget, "one model", block) for _ in range(2)]
    for i in range(200):
        tiers[i % 2].save(i.to_bytes(32, "big"), bytes([i % 256]) * block)
        total = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kv"))
        assert total <= budget + 2 * (budget // 8 + block + _HEADER.size), (i, total)
    assert tiers[0].blocks_written == tiers[1].blocks_written == 100
    gone = [i for i in range(200) if not tiers[0].contains(i.to_bytes(32, "big"))]
    assert gone and tiers[0].load(gone[0].to_bytes(32, "big")) is None
    assert tiers[0].rejected == 0
    kept = next(i for i in range(199, 0, -1) if i not in gone)
    tiers[1 - kept % 2].save(kept.to_bytes(32, "big"), bytes([kept % 256]) * block)
    assert tiers[0].load(kept.to_bytes(32, "big")) == bytes([kept % 256]) * block


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_writes_run_on_the_writer_thread_but_a_prefill_instance_waits_for_them(tmp_path, role):
    """A step's new blocks are written while the engine runs on (a write held back does not
    hold ``save``); a prefill instance's ``save`` returns once they are on disk; a decode
    instance writes nothing."""
    import threading
    from types import SimpleNamespace

    from pyxllm.engine.kv_cache_manager import KVCacheManager
    from pyxllm.engine.kv_connector import KVTierConnector
    from pyxllm.engine.kv_offload import DiskKVTier
    from pyxllm.engine.request import Request

    kv = KVCacheManager(8, 4)
    driver = SimpleNamespace(read_kv_block=lambda i: bytes([i]) * 64)
    tier = DiskKVTier(str(tmp_path), 2**20, "one model", 64)
    connector = KVTierConnector(tier, kv, driver, role)
    gate, save = threading.Event(), tier.save
    if role == "both":
        tier.save = lambda block_hash, payload: (gate.wait(30), save(block_hash, payload))
    request = Request("r", None, list(range(9)), SamplingParams(max_tokens=1), None)
    assert kv.allocate_slots(request, 9, [])  # registers its 2 full blocks of 4 tokens
    connector.save()
    if role == "both":
        assert tier.blocks_written == 0 and not list(tmp_path.glob("*/*/*.kv"))
        gate.set()
        connector.flush()
    assert tier.blocks_written == (0 if role == "decode" else 2)
    assert len(list(tmp_path.glob("*/*/*.kv"))) == tier.blocks_written
    connector.close()


def test_reads_run_on_the_reader_thread_while_the_request_waits_outside_the_queue(tmp_path):
    """A restarted engine's request whose blocks are on disk leaves the queue while they are
    read (a read held back holds up nothing), comes back with them in its prefix cache, and
    an abort meanwhile frees the blocks set aside."""
    import threading
    from collections import deque
    from types import SimpleNamespace

    from pyxllm.engine.kv_cache_manager import KVCacheManager
    from pyxllm.engine.kv_connector import KVTierConnector
    from pyxllm.engine.kv_offload import DiskKVTier
    from pyxllm.engine.metrics import EngineMetrics
    from pyxllm.engine.request import Request

    def engine(cache: dict):
        kv = KVCacheManager(8, 4)
        driver = SimpleNamespace(
            read_kv_block=lambda i: bytes([i + 1]) * 64, write_kv_block=cache.__setitem__
        )
        return kv, KVTierConnector(DiskKVTier(str(tmp_path), 2**20, "m", 64), kv, driver)

    def request(rid: str) -> Request:
        return Request(rid, None, list(range(9)), SamplingParams(max_tokens=1), None)

    kv, first = engine({})
    assert kv.allocate_slots(request("a"), 9, [])  # its 2 full blocks go to disk
    first.save()
    first.close()
    cache = {}
    kv, connector = engine(cache)
    gate, load = threading.Event(), connector.tier.load
    connector.tier.load = lambda block_hash: (gate.wait(30), load(block_hash))[1]
    again, scheduler = request("b"), SimpleNamespace(waiting=deque())
    scheduler.waiting.append(again)
    connector.load(scheduler)
    assert not scheduler.waiting and set(connector.loading) == {"b"}
    assert kv.num_free_blocks == 6 and not cache  # 2 set aside, nothing written yet
    scheduler.running, scheduler.num_preemptions = [], 0
    registry = EngineMetrics("m", scheduler, kv, connector).registry
    assert registry.get_sample_value("vllm:num_requests_waiting", {"model_name": "m"}) == 1
    connector.load(scheduler)  # still reading
    assert not scheduler.waiting
    gate.set()
    connector.wait_for_loads(30)
    while connector.loading:
        connector.load(scheduler)
    assert list(scheduler.waiting) == [again] and kv.num_free_blocks == 8
    assert len(kv.get_computed_blocks(again)) == 2 and connector.num_hits == 8
    assert sorted(cache.values()) == [bytes([1]) * 64, bytes([2]) * 64]
    # an abort while its blocks are read
    gate.clear()
    kv.reset_prefix_cache()
    connector.load(scheduler)
    assert set(connector.loading) == {"b"} and kv.num_free_blocks == 6
    connector.cancel(again, scheduler)
    assert not connector.loading and list(scheduler.waiting) == [again]
    assert kv.num_free_blocks == 8 and not kv.get_computed_blocks(again)
    gate.set()
    connector.close()
