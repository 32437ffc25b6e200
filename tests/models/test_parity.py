"""Greedy float32 tokens from pyxllm equal transformers' on the embedded SmolLM2 GGUF."""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams

NEW_TOKENS = 32
CHATS = [
    "What is the capital of France?",
    "What is 2+3?",
    "中国的首都是哪里？",
    "Write a haiku about the sea.",
]
COMPLETIONS = [
    "def fibonacci(n):",
    "The three primary colors are",
    "Ünïcödé and émojis 🙂 are",
    # long enough to span more than 3 KV blocks of 16 tokens
    "In the beginning of the twentieth century, the small harbour town was known for its fishing "
    "fleet, "
    "its lighthouse and its market, where traders from the whole coast came every Saturday to "
    "sell fish, "
    "bread, cloth and tools. Over the years the market grew, the harbour was deepened for larger "
    "ships, "
    "and a railway line reached the town from the capital. The mayor decided that",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm):
    tokenizer = llm.get_tokenizer()
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHATS]
    plain = [tokenizer.encode(p) for p in COMPLETIONS]
    return chat + plain


def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` that, like ``ignore_eos``, runs past EOS."""
    out, past, inputs = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            inputs = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module")
def reference(hf_gguf_model, prompts):
    return [hf_greedy(hf_gguf_model, ids, NEW_TOKENS) for ids in prompts]


def test_greedy_one_at_a_time_matches_transformers(llm, prompts, reference):
    for ids, ref in zip(prompts, reference):
        out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
        assert out.token_ids == ref
        assert len(out.token_ids) == NEW_TOKENS


def test_greedy_batched_matches_transformers(llm, prompts, reference):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("max_tokens_per_batch", [5, 16])
def test_chunked_prefill_in_mixed_batches_matches(prompts, reference, max_tokens_per_batch):
    """Small step budgets split prompts into chunks that share steps with other requests'
    decodes (the longest prompt spans more than 3 KV blocks of 16 tokens)."""
    llm = LLM(dtype="float32", max_tokens_per_batch=max_tokens_per_batch, kv_cache_memory=0.25)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_text_matches_transformers_decode(llm, hf_gguf_tokenizer):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
