"""Sampling features through the offline engine: ``n`` fan-out, seeds, prompt logprobs across
prefill chunks and prefix-cache hits (top-k dicts, and the whole vocabulary as one tensor),
aborting a parent request, ``min_tokens`` and stops."""

from __future__ import annotations

import math

import pytest
import torch

from pyxllm.entrypoints.llm import LLM
from pyxllm.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def llm():
    # 8-token steps: a prompt is prefilled in several chunks
    return LLM(
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=0.05,
        max_tokens_per_batch=8,
        block_size=4,
    )


def _values(logprobs, ids):
    return [entry[t].logprob for entry, t in zip(logprobs, ids)]


def test_prompt_logprobs_across_chunks_equal_the_sampled_ones(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0]
    generated = greedy.outputs[0]
    ids = greedy.prompt_token_ids + generated.token_ids
    scored = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=3)
    )[0]
    assert len(scored.prompt_logprobs) == len(ids) and scored.prompt_logprobs[0] is None
    tail = scored.prompt_logprobs[len(greedy.prompt_token_ids) :]
    for a, b in zip(
        _values(tail, generated.token_ids), _values(generated.logprobs, generated.token_ids)
    ):
        assert math.isclose(a, b, abs_tol=1e-4)
    for pos, entry in enumerate(scored.prompt_logprobs[1:], start=1):
        assert ids[pos] in entry and len(entry) <= 4
        ranked = sorted(
            (e for t, e in entry.items() if t != ids[pos] or e.rank <= 3), key=lambda e: e.rank
        )
        assert [e.rank for e in ranked][:3] == [1, 2, 3]
    # again: the prompt's blocks are cached now, but prompt logprobs need every position
    again = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    assert _values(again.prompt_logprobs[1:], ids[1:]) == pytest.approx(
        _values(scored.prompt_logprobs[1:], ids[1:]), abs=1e-5
    )


def test_full_vocab_prompt_logprobs_are_one_tensor_across_chunks(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    full = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    out = llm.generate({"prompt_token_ids": ids}, full)[0]
    rows = out.prompt_logprobs_tensor
    assert out.prompt_logprobs is None and rows.dtype == torch.float32
    assert rows.shape == (len(ids) - 1, 49152) and rows.device.type == "cpu"
    assert torch.allclose(rows.exp().sum(dim=-1), torch.ones(len(ids) - 1), atol=1e-4)
    top = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1))
    entries = top[0].prompt_logprobs[1:]
    given = rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert given.tolist() == pytest.approx(_values(entries, ids[1:]), abs=1e-5)
    best = [next(t for t, e in entry.items() if e.rank == 1) for entry in entries]
    assert rows.argmax(dim=-1).tolist() == best
    # the prompt's blocks are cached now; every position is computed again, and with n = 2 the
    # first child's rows come back on the parent's output
    again = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(n=2, max_tokens=1, prompt_logprobs=-1)
    )
    assert torch.allclose(again[0].prompt_logprobs_tensor, rows, atol=1e-5)
    with pytest.raises(ValueError, match=r"^logprobs: must be in \[0, 20\], got -1"):
        SamplingParams(logprobs=-1)


def test_n_children_are_independent_and_seeded(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=6))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(c.finish_reason is not None for c in out.outputs)
    single = [
        llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=42 + i, max_tokens=6))[0].outputs[
            0
        ]
        for i in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in single]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_aborting_a_parent_aborts_every_child(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=3, max_tokens=50, ignore_eos=True)
    engine.add_request(engine.input_processor.process("parent", PROMPT, params))
    engine.step()
    assert len(engine.requests) == 3
    engine.abort_request("parent")
    assert not engine.requests and not engine.parents and not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_used_blocks == 0


def test_min_tokens_defers_every_stop(llm):
    tokenizer = llm.get_tokenizer()
    first = (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    )
    stopped = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first])
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    held = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=10,
            stop_token_ids=[first],
            min_tokens=4,
            logit_bias={first: 50.0},
        ),
    )[0].outputs[0]
    assert (
        first not in held.token_ids[:4]
        and held.token_ids[4:] == [first]
        and held.finish_reason == "stop"
    )
    text = tokenizer.decode(held.token_ids[:4])
    stop_str = text[:3]  # matched in the first tokens: only counts once min_tokens is reached
    late = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=6,
            min_tokens=6,
            stop=[stop_str],
            logit_bias={first: 50.0},
            stop_token_ids=[first],
        ),
    )[0].outputs[0]
    assert len(late.token_ids) == 6 and late.finish_reason == "length"
