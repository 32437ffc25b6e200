"""Prefix caching, chunked prefill and preemption change no token (greedy, float32, token ids).

Three engines on the embedded SmolLM2, shared by every test of the module:
``ref`` (no prefix cache, no chunked prefill: each prompt in one step; the reference),
``cached`` (the defaults: prefix cache and chunked prefill on) and ``small`` (prefix cache on,
a KV cache of 17 blocks of 16 tokens, so requests evict each other's blocks and get preempted).
"""

from __future__ import annotations

import pytest

from pyxllm import LLM, SamplingParams

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a small public library. You answer questions about opening "
    "hours, borrowing rules, late fees and events in short, friendly sentences, and you never "
    "invent facts. The library opens at nine and closes at six, except on Sundays. "
)
QUESTIONS = [
    "Question: can I borrow five books at once? Answer:",
    "Question: what happens if I return a book late? Answer:",
    "Question: is the library open on Sunday? Answer:",
    "Question: do you host reading events for children? Answer:",
]
OTHER = [
    "The history of the printing press begins in the fifteenth century, when",
    "def quicksort(values):\n    if len(values) <= 1:\n        return values\n    pivot =",
    "Ocean tides are caused mainly by the gravitational pull of the moon, and",
    "A recipe for bread needs flour, water, salt and yeast. First, mix",
]


def engine_llm(**kwargs) -> LLM:
    return LLM(dtype="float32", max_model_len=512, **kwargs)


@pytest.fixture(scope="module")
def ref():
    return engine_llm(
        enable_prefix_cache=False,
        enable_chunked_prefill=False,
        max_tokens_per_batch=512,
        kv_cache_memory=0.1,
    )


@pytest.fixture(scope="module")
def cached():
    return engine_llm(kv_cache_memory=0.1)


@pytest.fixture(scope="module")
def small():
    llm = engine_llm(kv_cache_memory=0.012)
    assert llm.llm_engine.kv_cache_manager.num_blocks == 17
    return llm


@pytest.fixture(scope="module")
def prompts(ref):
    encode = ref.get_tokenizer().encode
    return [encode(SYSTEM + q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def other_prompts(ref):
    return [ref.get_tokenizer().encode(p) for p in OTHER]


@pytest.fixture(scope="module")
def edge_prompts(prompts):
    """A prompt of exactly three blocks, and one of three blocks and one token."""
    return [prompts[0][:48], prompts[1][:49]]


@pytest.fixture(scope="module")
def expected(ref, prompts, other_prompts, edge_prompts):
    """The reference engine's tokens for every prompt of the module, by prompt."""
    everything = prompts + other_prompts + edge_prompts
    return {tuple(p): out for p, out in zip(everything, run(ref, everything))}


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def metric(llm: LLM, name: str) -> float:
    engine = llm.llm_engine
    return engine.metrics.registry.get_sample_value(name, {"model_name": engine.model_name})


def hits(llm: LLM) -> float:
    return metric(llm, "vllm:prefix_cache_hits_total")


def test_reference_engine_is_unchunked_and_uncached(ref, prompts, other_prompts, expected):
    assert not ref.llm_engine.scheduler.chunked_prefill
    assert run(ref, [prompts[1]]) == [expected[tuple(prompts[1])]]  # one at a time == batched
    assert hits(ref) == 0
    assert all(len(p) > 3 * 16 for p in prompts)


def test_prefix_cache_cold_then_warm(cached, prompts, expected):
    want = [expected[tuple(p)] for p in prompts]
    shared_tokens = len(cached.get_tokenizer().encode(SYSTEM)) // 16 * 16
    kv = cached.llm_engine.kv_cache_manager
    kv.reset_prefix_cache()
    before = hits(cached)
    assert run(cached, prompts[:1]) == want[:1]  # cold: nothing to hit
    assert hits(cached) == before
    kv.reset_prefix_cache()
    assert (
        run(cached, prompts) == want
    )  # cold, but later prompts hit blocks the first fills in the same step
    assert hits(cached) - before == (len(prompts) - 1) * shared_tokens
    before = hits(cached)
    assert run(cached, prompts) == want  # warm: every prompt hits
    assert hits(cached) - before >= len(prompts) * shared_tokens
    assert cached.llm_engine.stats()["num_kv_blocks_used"] == 0


def test_block_aligned_prompt_fully_cached(cached, edge_prompts, expected):
    aligned, one_past = edge_prompts
    want = [expected[tuple(aligned)], expected[tuple(one_past)]]
    assert run(cached, [aligned]) == want[:1]
    before = hits(cached)
    assert run(cached, [aligned]) == want[:1]
    assert hits(cached) - before == 32  # 100 % cached, the last block is recomputed
    run(cached, [one_past])
    before = hits(cached)
    assert run(cached, [one_past]) == want[1:]
    assert hits(cached) - before == 48  # only the last token is recomputed


def test_prefix_cache_after_eviction(small, prompts, expected):
    target = prompts[0]
    small.llm_engine.kv_cache_manager.reset_prefix_cache()
    assert run(small, [target]) == [expected[tuple(target)]]
    before = hits(small)
    assert run(small, [target]) == [expected[tuple(target)]]
    assert hits(small) > before  # warm
    # other traffic, prefill only: four prompts of seven blocks, none sharing a block with the
    # target
    encode, one = small.get_tokenizer().encode, SamplingParams(temperature=0, max_tokens=1)
    small.generate(
        [{"prompt_token_ids": encode(f"Note {i}. " + SYSTEM * 2)} for i in range(4)], one
    )
    before = hits(small)
    assert run(small, [target]) == [expected[tuple(target)]]
    assert hits(small) == before  # the other traffic evicted every block of the target


@pytest.mark.parametrize("engine, budget", [("ref", 1), ("cached", 4), ("ref", 16)])
def test_chunked_prefill_budgets(request, engine, budget, prompts, other_prompts, expected):
    """Tiny budgets split prompts into chunks that share steps with other requests' decodes
    (on ``cached`` also with prefix-cache hits on blocks filled in earlier chunks)."""
    llm = request.getfixturevalue(engine)
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    batch = [prompts[0], other_prompts[0]] if budget == 1 else prompts[:2] + other_prompts[:2]
    scheduler = llm.llm_engine.scheduler
    saved = scheduler.max_tokens, scheduler.chunked_prefill
    scheduler.max_tokens, scheduler.chunked_prefill = budget, True
    try:
        assert run(llm, batch) == [expected[tuple(p)] for p in batch]
    finally:
        scheduler.max_tokens, scheduler.chunked_prefill = saved


def test_preemption_gives_the_same_tokens(small, prompts, other_prompts, expected):
    batch = prompts + other_prompts
    before = metric(small, "vllm:num_preemptions_total")
    assert run(small, batch) == [expected[tuple(p)] for p in batch]
    assert metric(small, "vllm:num_preemptions_total") > before
    assert small.llm_engine.stats()["num_kv_blocks_used"] == 0
