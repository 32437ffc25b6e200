"""The request front door: one rule per check, the same for ``LLM`` and the HTTP server.

The model is a tiny random Llama whose embedding has 64 rows more than its tokenizer has tokens
(as Qwen's 151,936 against 151,669) and whose generation_config.json sets four sampling
defaults; the server and ``LLM`` load the same directory.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import httpx
import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.engine.input_processor import (
    ChatPrompt,
    InputProcessor,
    InvalidRequestError,
    TokensPrompt,
)
from tests.model_fixtures import build_hf_model, save_checkpoint, tiny_config
from tests.utils import RemoteServer

EXTRA_ROWS = 64
MAX_MODEL_LEN = 128
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 5, "repetition_penalty": 1.3}
PROMPT_IDS = [1, 504, 3458, 314, 4866, 30]
ARGS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory": 0.05}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_gguf_tokenizer):
    vocab_size = len(hf_gguf_tokenizer) + EXTRA_ROWS
    model = build_hf_model(tiny_config("llama", vocab_size=vocab_size))
    directory = save_checkpoint(model, tmp_path_factory.mktemp("padded-vocab"), hf_gguf_tokenizer)
    config = {"bos_token_id": 1, "eos_token_id": 2, **GENERATION_DEFAULTS}
    (directory / "generation_config.json").write_text(json.dumps(config))
    return SimpleNamespace(
        path=directory, vocab_size=vocab_size, tokenizer_len=len(hf_gguf_tokenizer)
    )


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint.path), **ARGS)


@pytest.fixture(scope="module")
def server(checkpoint):
    flags = ["--model", str(checkpoint.path), "--served-model-name", "padded"]
    for name, value in ARGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    with RemoteServer(flags) as remote:
        yield remote


def complete(server: RemoteServer, **body) -> httpx.Response:
    body = {"model": "padded", **body}
    return httpx.post(server.url_for("v1", "completions"), json=body, timeout=60)


def test_a_token_id_past_the_tokenizer_but_in_the_embedding_is_valid_everywhere(
    checkpoint, llm, server
):
    """One vocabulary rule, the model's rows: HTTP used to refuse what ``LLM`` accepted."""
    gap_id = checkpoint.tokenizer_len + 3
    prompt = [*PROMPT_IDS, gap_id]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[gap_id])
    offline = llm.generate({"prompt_token_ids": prompt}, greedy)[0].outputs[0]
    response = complete(
        server,
        prompt=prompt,
        temperature=0,
        max_tokens=4,
        ignore_eos=True,
        stop_token_ids=[gap_id],
        logit_bias={str(gap_id): -5},
    )
    assert response.status_code == 200, response.text
    assert len(offline.token_ids) == 4
    assert response.json()["choices"][0]["text"] == offline.text


@pytest.mark.parametrize("field", ["prompt", "stop_token_ids", "logit_bias"])
def test_a_token_id_past_the_embedding_is_refused_alike(checkpoint, llm, server, field):
    bad = checkpoint.vocab_size
    values = {"prompt": [*PROMPT_IDS, bad], "stop_token_ids": [bad], "logit_bias": {bad: 1.0}}
    expected = f"{field}: token id {bad} is out of range [0, {checkpoint.vocab_size})"
    prompt, fields = PROMPT_IDS, {}
    if field == "prompt":
        prompt = values["prompt"]
    else:
        fields[field] = values[field]
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, **fields))
    body = {
        k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
        for k, v in fields.items()
    }
    response = complete(server, prompt=prompt, max_tokens=2, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert str(offline.value) == error["message"] == expected
    assert error["param"] == field


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN, None])
def test_one_length_rule_with_one_message(llm, server, max_tokens):
    prompt = PROMPT_IDS * (MAX_MODEL_LEN // len(PROMPT_IDS) + (max_tokens is None))
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens))
    response = complete(server, prompt=prompt, max_tokens=max_tokens)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message == str(offline.value)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
    assert f"{len(prompt)} prompt tokens" in message
    requested = "at least 1" if max_tokens is None else str(max_tokens)
    assert f"plus {requested} completion tokens" in message


def test_llm_takes_the_models_generation_defaults_as_the_server_does(llm, server):
    """``SamplingParams()`` and a request that omits the fields both sample with the
    generation_config values (seeded, so the tokens show it)."""
    seeded = dict(seed=11, max_tokens=12, ignore_eos=True)
    processed = llm.llm_engine.input_processor.process(
        "x", TokensPrompt(PROMPT_IDS), SamplingParams()
    )
    assert {
        k: getattr(processed.sampling_params, k) for k in GENERATION_DEFAULTS
    } == GENERATION_DEFAULTS

    def tokens(params: SamplingParams) -> list[int]:
        return llm.generate({"prompt_token_ids": PROMPT_IDS}, params)[0].outputs[0].token_ids

    unset = tokens(SamplingParams(**seeded))
    assert unset == tokens(SamplingParams(**seeded, **GENERATION_DEFAULTS))
    vllm_defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    assert unset != tokens(SamplingParams(**seeded, **vllm_defaults))
    response = complete(server, prompt=PROMPT_IDS, logprobs=0, **seeded)
    assert response.status_code == 200, response.text
    served = response.json()["choices"][0]
    text = llm.get_tokenizer().decode(unset)
    assert served["text"] == text and len(served["logprobs"]["tokens"]) == len(unset)


# --- the processor alone (a fake tokenizer, no model) ------------------------------------------


def processor(max_kv_blocks: int = 4, **defaults) -> InputProcessor:
    tokenizer = SimpleNamespace(
        encode=lambda text, add_special_tokens=True: [3] * len(text.split()),
        apply_chat_template=lambda messages, add_generation_prompt=True, **kw: [4] * len(messages),
    )
    return InputProcessor(
        tokenizer,
        vocab_size=10,
        max_model_len=32,
        max_kv_blocks=max_kv_blocks,
        block_size=8,
        generation_defaults=defaults,
    )


def test_unset_max_tokens_takes_the_model_default_capped_to_the_room_left():
    assert (
        processor(max_tokens=5)
        .process("a", "one two", SamplingParams(max_tokens=None))
        .sampling_params.max_tokens
        == 5
    )
    # the room the context leaves (32 - 2 = 30) is more than 3 blocks of 8 hold: refused by name
    with pytest.raises(InvalidRequestError, match="need 4 KV blocks but the cache has 3"):
        processor(max_kv_blocks=3).process("b", "one two", SamplingParams(max_tokens=None))
    assert (
        processor(max_tokens=99)
        .process("c", TokensPrompt([1] * 10), SamplingParams(max_tokens=None))
        .sampling_params.max_tokens
        == 22
    )


def test_errors_name_the_field_the_prompt_came_from():
    chat = ChatPrompt([{"role": "user", "content": "hi"}] * 20)
    with pytest.raises(InvalidRequestError) as info:
        processor().process("a", chat, SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        processor().process(
            "b", ChatPrompt([{"role": "user", "content": "hi"}] * 40), SamplingParams()
        )
    assert info.value.param == "messages"
    for prompt in ("", TokensPrompt([])):
        with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
            processor().process("c", prompt)


def test_a_field_the_request_sets_wins_over_the_model():
    params = SamplingParams(temperature=0.0, top_k=2)
    got = processor(temperature=0.5, top_k=7, top_p=0.3).process("a", "x y", params).sampling_params
    assert (got.temperature, got.top_k, got.top_p) == (0.0, 2, 0.3)
    assert params.unset_fields == {
        "top_p",
        "min_p",
        "repetition_penalty",
    }  # the caller's copy is untouched
    assert params.top_p == 1.0


def test_sampling_params_are_immutable_and_a_changed_copy_keeps_what_is_unset():
    """A built ``SamplingParams`` cannot be edited; ``replace`` gives a checked copy whose
    fields left unset still take the model's values when processed."""
    params = SamplingParams(top_k=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0
    copy = params.replace(max_tokens=3, top_p=0.5)
    assert (copy.max_tokens, copy.top_p, params.max_tokens, params.top_p) == (3, 0.5, 16, 1.0)
    assert copy.unset_fields == {"temperature", "min_p", "repetition_penalty"}
    got = processor(temperature=0.7, top_p=0.3).process("a", "x y", copy).sampling_params
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (0.7, 0.5, 2, 3)
    with pytest.raises(ValueError, match="top_p: must be in"):
        params.replace(top_p=2.0)
