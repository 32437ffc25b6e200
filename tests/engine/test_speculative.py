"""Speculative decoding with n-gram drafts never changes what a request gets.

On the default model in float32: greedy output with speculation equals output without it, token
for token, on 16 prompts (half of them copy from their context, so drafts are accepted often),
alone and batched, with chunked prefill and a second pass from the prefix cache; stop strings,
stop tokens inside an accepted run, ``max_tokens`` 1..k+1, ``n = 2``, logprobs and a
structured-output request give what the engine without speculation gives; a seeded sampled
request gives the same text with and without speculation; and no KV block is left in use.
The distribution of sampled tokens with speculation matches the one without (chi-square). A
draft model (tiny random checkpoints) gives the target's greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.config import EngineConfig
from pyxllm.engine.proposers import NgramProposer
from pyxllm.engine.request import Request
from pyxllm.engine.structured_output import StructuredOutputManager
from pyxllm.sampling_params import StructuredOutputsParams
from tests.model_fixtures import build_checkpoint, build_hf_model, save_checkpoint, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 64}
ENGINE = dict(max_model_len=512, kv_cache_memory=0.2, max_tokens_per_batch=96)
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day, and the "
    "fox runs through the forest looking for food."
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
GROUNDED = [
    f"Repeat this text exactly:\n{PASSAGE}\nRepeated:\n",
    f"Copy the code below.\n{CODE}\nCopy:\n",
    f"{PASSAGE} {PASSAGE[:60]}",
    "Here is a list: apple, banana, cherry, apple, banana, cherry, apple,",
    f"{CODE}\n# the same two functions again\n",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    f"Summarize: {PASSAGE}\nSummary: The quick brown fox",
    "<b>bold</b> <i>italic</i> <b>bold</b> <i>",
]
FREE = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Name three prime numbers.",
    "Tell me a joke.",
    "How do airplanes fly?",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
]
PROMPTS = GROUNDED + FREE
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    """(without speculation, with n-gram speculation) on the default model."""
    return LLM(**ENGINE), LLM(speculative_config=SPEC, **ENGINE)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_bad_configs_fail_naming_the_key():
    cases = {
        '{"method": "medusa", "num_speculative_tokens": 2}': "method must be one of",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens must be",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
        '"prompt_lookup_max": 2}': "prompt_lookup_min (3) must not exceed",
        '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}': "unknown key 'k'",
        '{"method": "ngram"}': "num_speculative_tokens is required",
        "[1]": "must be a JSON object",
    }
    for text, message in cases.items():
        with pytest.raises(ValueError, match="^--speculative-config: ") as e:
            EngineConfig(speculative_config=text)
        assert message in str(e.value)


def test_ngram_proposer_takes_the_longest_most_recent_match():
    proposer = NgramProposer(k=3, min_n=1, max_n=3)
    # suffix [7, 8] occurred twice; the most recent is followed by 9, 1
    assert proposer.propose([7, 8, 5, 7, 8, 9, 1, 2, 7, 8]) == [9, 1, 2]
    assert proposer.propose([1, 2, 3, 4]) == []  # no earlier occurrence of any suffix
    assert proposer.propose([5, 6, 5, 6], max_tokens=1) == [5]
    assert NgramProposer(k=2, min_n=2, max_n=2).propose([3, 9, 3, 4, 3]) == []  # min_n 2


def test_greedy_output_equals_decoding_without_speculation(engines):
    plain, spec = engines
    want = tokens(plain.generate(PROMPTS, GREEDY))
    metrics = spec.llm_engine.metrics
    before = metrics.num_spec_accepted
    assert tokens(spec.generate(PROMPTS, GREEDY)) == want  # batched
    alone = [tokens(spec.generate([p], GREEDY))[0] for p in PROMPTS[:4] + PROMPTS[-2:]]
    assert alone == want[:4] + want[-2:]
    again = tokens(spec.generate(PROMPTS, GREEDY))  # from the prefix cache
    assert spec.llm_engine.kv_cache_manager.num_hits > 0
    assert again == want
    # the grounded prompts copy: drafts were accepted often
    assert metrics.num_spec_accepted - before > 40
    assert metrics.num_spec_accepted <= metrics.num_spec_draft_tokens
    stats = spec.llm_engine.stats()
    assert stats["num_kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_stops_and_lengths_inside_accepted_runs(engines):
    plain, spec = engines
    prompt = GROUNDED[0]
    greedy = plain.generate([prompt], GREEDY)[0].outputs[0]
    reference, text = list(greedy.token_ids), greedy.text
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, K + 3)]
    cases += [
        SamplingParams(temperature=0, max_tokens=24, stop=[text[30:36]]),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[9]]),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[9]], min_tokens=12),
        SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=16, n=2, seed=5, ignore_eos=True),
    ]
    wants = plain.generate([prompt] * len(cases), cases)
    gots = spec.generate([prompt] * len(cases), cases)
    for params, want, got in zip(cases, wants, gots, strict=True):
        for w, g in zip(want.outputs, got.outputs, strict=True):
            assert g.token_ids == w.token_ids and g.text == w.text, params
            assert g.finish_reason == w.finish_reason and g.stop_reason == w.stop_reason
            if params.logprobs is not None:
                assert len(g.logprobs) == len(g.token_ids)
                for a, b in zip(g.logprobs, w.logprobs):
                    assert a.keys() == b.keys()
                    for t in a:
                        assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert spec.llm_engine.stats()["num_kv_blocks_used"] == 0


def test_seeded_sampling_and_structured_outputs_are_unchanged(engines):
    plain, spec = engines
    sampled = [
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, seed=s, ignore_eos=True)
        for s in range(6)
    ]
    prompts = [GROUNDED[i % 3] for i in range(6)]
    want = tokens(plain.generate(prompts, sampled))
    assert tokens(spec.generate(prompts, sampled)) == want  # batched together
    assert tokens(spec.generate(prompts[:1], sampled[:1])) == want[:1]  # alone
    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["fox", "dog"]}},
        "required": ["name"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    prompt = f"{PASSAGE}\nGive the animal's name as JSON:"
    want = plain.generate([prompt], constrained)[0].outputs[0]
    got = spec.generate([prompt], constrained)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert json.loads(got.text)["name"]
    # a constrained output that copies its prompt: drafts cut by the grammar, then verified
    quote = {"type": "object", "properties": {"quote": {"type": "string"}}, "required": ["quote"]}
    copy = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=quote)
    )
    prompt = f"Copy this JSON exactly:\n{json.dumps({'quote': PASSAGE})}\nCopy:\n"
    want = plain.generate([prompt], copy)[0].outputs[0]
    metrics = spec.llm_engine.metrics
    before = metrics.num_spec_accepted
    got = spec.generate([prompt], copy)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert json.loads(got.text)["quote"].startswith("The quick brown fox jumps")
    assert metrics.num_spec_accepted - before > 10
    assert spec.llm_engine.stats()["num_kv_blocks_used"] == 0


def test_the_graph_runner_replays_verification_steps(engines):
    """With --graph-backend graph a step with drafts replays the decode graphs (a row per
    verified token) and gives the eager engine's tokens."""
    plain, _ = engines
    llm = LLM(graph_backend="graph", speculative_config=SPEC, max_seqs_per_batch=8, **ENGINE)
    prompts = [GROUNDED[0], GROUNDED[1], FREE[0]]
    want = tokens(plain.generate(prompts, GREEDY))
    assert [tokens(llm.generate([p], GREEDY))[0] for p in prompts] == want
    runner = llm.llm_engine.executor.driver.runner
    # one sequence alone: more than one row only when it verifies drafts (4 drafts: bucket 5)
    assert runner.sizes == [1, 2, 4, 5, 8]
    assert runner.replays[1] > 0 and runner.replays[5] >= 5
    assert sum(runner.replays.values()) - runner.replays[1] >= 8
    assert tokens(llm.generate(prompts, GREEDY)) == want  # up to 15 rows: some run eagerly
    assert llm.llm_engine.metrics.num_spec_accepted > 40
    assert llm.llm_engine.stats()["num_kv_blocks_used"] == 0


def test_int4_verification_reproduces_decoding_bit_for_bit():
    """int4's fused kernel computes a row alike in any batch, and verified drafts attend through
    the decode kernel (eagerly too), so a verifying step's logits are those of decoding one
    token at a time: on free-form text, where drafts are often rejected, the tokens match over
    long runs, and so do the logprobs, exactly. Short prompts (up to k + 1 tokens) prefill
    eagerly, not as replayed decode rows (their first token differed before)."""
    options = dict(quantization="int4", **ENGINE)
    plain, spec = LLM(**options), LLM(speculative_config=SPEC, graph_backend="graph", **options)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    prompts = [FREE[1], FREE[4], "Hi", GROUNDED[3]]
    # one request at a time on both (a batch of prompts prefills over 32 rows: a GEMM there)
    want, got = ([e.generate([p], params)[0] for p in prompts] for e in (plain, spec))
    assert tokens(got) == tokens(want)
    for a, b in zip(want, got):
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs
        ]
    assert spec.llm_engine.metrics.num_spec_draft_tokens > spec.llm_engine.metrics.num_spec_accepted


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_draft_bitmask_rows_follow_the_drafts(backend, hf_gguf_tokenizer):
    """Row ``j`` of a drafted sequence's bitmask is the matcher's mask after ``j`` drafts; the
    matcher ends where it started; a refused draft cuts the run (its row forbids it)."""
    eos = [hf_gguf_tokenizer.eos_token_id]
    manager = StructuredOutputManager(backend, hf_gguf_tokenizer, 49152, eos)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    handle = manager.submit(StructuredOutputsParams(json=schema))
    handle.compiled()
    matcher = handle.new_matcher()
    drafts = hf_gguf_tokenizer.encode('{"name": "fox"}')
    refused = hf_gguf_tokenizer.encode("]")[0]
    assert matcher.validate_tokens([*drafts[:3], refused, *drafts[3:]]) == 3
    rows = manager.fill_draft_bitmask(matcher, drafts[:4])
    assert rows.shape == (5, 49152 // 32)
    for j in range(5):  # the matcher was rolled back: accepting again reproduces each row
        assert torch.equal(rows[j], manager.fill_bitmask([matcher])[0][0]), j
        if j < 4:
            assert matcher.accept_token(drafts[j])
    matcher.rollback(4)
    cut = manager.fill_draft_bitmask(matcher, [drafts[0], refused, drafts[1]])
    assert torch.equal(cut[:2], rows[:2])
    assert not cut[1, refused // 32] >> (refused % 32) & 1
    assert torch.equal(cut[2], cut[3])  # past the refused draft: EOS rows, never used
    manager.shutdown()


def test_drafts_do_not_cross_the_end_of_reasoning():
    """While the reasoning runs, drafts stop before the token that would end it: the tokens
    after the end are constrained and drafted rows carry no mask."""
    request = Request("r", None, [1, 2, 7], SamplingParams(), detokenizer=None)
    request.matcher, request.constrain_after = object(), (7, 8)
    assert request.allowed_drafts([8, 9]) == []  # 7 then 8 ends it at the first draft
    assert request.allowed_drafts([5, 7, 8, 9]) == [5, 7]
    assert request.allowed_drafts([5, 6]) == [5, 6]


def test_a_thinking_budget_holds_inside_accepted_runs(engines):
    """A thinking budget (any token serves as the end of the thinking here) forces the end tag
    after the model's first ``budget`` greedy tokens; with speculation the drafts stop where
    forcing begins, so the tokens are the same (the grounded prompts' drafts run long)."""
    plain, spec = engines
    budget, end = 6, 42
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        thinking_token_budget=budget,
        think_end_token_ids=(end,),
    )
    free = tokens(plain.generate(GROUNDED, GREEDY))
    want = tokens(plain.generate(GROUNDED, params))
    for forced, reference in zip(want, free):
        if end not in reference[:budget]:
            assert forced[: budget + 1] == [*reference[:budget], end]
    before = spec.llm_engine.metrics.num_spec_accepted
    assert tokens(spec.generate(GROUNDED, params)) == want
    assert spec.llm_engine.metrics.num_spec_accepted > before


def test_sampled_distribution_matches_decoding_without_speculation():
    """Unseeded draws continuing a repeated pattern (the n-gram drafts it; the model mostly
    follows, sometimes not), with and without speculation, on engines of different seeds: the
    counts of the tokens at output positions 2..5 over the 12 most frequent agree (chi-square,
    11 degrees of freedom, threshold 31.3 = p 0.001)."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=5, ignore_eos=True)
    prompt = "7 3 9 1 7 3 9 1 7 3 9 1 7 3"
    counts = []
    for seed, spec in ((0, None), (1, SPEC)):
        llm = LLM(speculative_config=spec, seed=seed, max_model_len=64, kv_cache_memory=0.2)
        outs = llm.generate([prompt] * 96, params)
        later = torch.tensor([t for o in outs for t in o.outputs[0].token_ids[1:]])
        counts.append(torch.bincount(later, minlength=49152).double())
        if spec is not None:
            metrics = llm.llm_engine.metrics
            assert metrics.num_spec_accepted > 40
            assert metrics.num_spec_accepted < metrics.num_spec_draft_tokens  # some rejected
    top = torch.topk(counts[0] + counts[1], 12).indices
    a, b = counts[0][top], counts[1][top]
    expected = (a + b) / 2
    chi2 = float((((a - expected) ** 2 + (b - expected) ** 2) / expected).sum())
    assert chi2 < 31.3, (chi2, a.tolist(), b.tolist())


def test_draft_model_gives_the_targets_greedy_tokens(tmp_path, hf_gguf_tokenizer):
    """A draft model: the target as its own draft accepts every draft; another tiny model with
    the same vocabulary is often wrong, and the output is still the target's; a draft with
    another vocabulary is refused at start-up."""
    target, _ = build_checkpoint("llama", tmp_path / "target", hf_gguf_tokenizer, seed=1)
    other, _ = build_checkpoint("qwen3", tmp_path / "other", hf_gguf_tokenizer, seed=2)
    engine = dict(max_model_len=160, kv_cache_memory=0.05, max_tokens_per_batch=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[::2]
    want = tokens(LLM(model=str(target), **engine).generate(prompts, params))
    for draft, all_accepted in ((target, True), (other, False)):
        spec = {**SPEC, "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        llm = LLM(model=str(target), speculative_config=spec, **engine)
        assert tokens(llm.generate(prompts, params)) == want
        assert tokens(llm.generate(prompts[:1], params)) == want[:1]  # alone, prefix-cached
        metrics = llm.llm_engine.metrics
        assert metrics.num_spec_draft_tokens > 50
        assert (metrics.num_spec_accepted == metrics.num_spec_draft_tokens) == all_accepted
        assert llm.llm_engine.stats()["num_kv_blocks_used"] == 0
    small = build_hf_model(tiny_config("llama", vocab_size=1024))
    save_checkpoint(small, tmp_path / "small", hf_gguf_tokenizer)
    spec = {"method": "draft_model", "model": str(tmp_path / "small"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target 49152"):
        LLM(model=str(target), speculative_config=spec, **engine)
    # a draft that is not there is named as the draft (the message spoke of the served model)
    spec = {**spec, "model": str(tmp_path / "none")}
    with pytest.raises(ValueError, match=r"--speculative-config: the draft model '.*none' cannot"):
        LLM(model=str(target), speculative_config=spec, **engine)
