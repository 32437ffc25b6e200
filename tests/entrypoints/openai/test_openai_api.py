"""The OpenAI request surface end to end (sampling fields, logprobs, echo, n, usage chunks and
the tokenizer routes): a real ``pyxllm serve`` on the default model, driven with the ``openai``
SDK and raw HTTP."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from openai.types.completion_choice import Logprobs

from tests.utils import RemoteServer, stub_app_client

MODEL = "smollm2-api"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
EOS = 2  # <|im_end|>
THE = 260  # " the"


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "0.25"]
    with RemoteServer([*args, "--enable-tokenizer-info-endpoint"]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for(path), json={"model": MODEL, **body}, timeout=60)


def tokenize(server: RemoteServer, text: str, **kwargs) -> list[int]:
    return post(server, "tokenize", {"prompt": text, **kwargs}).json()["tokens"]


# --- logprobs -------------------------------------------------------------------------------


def test_chat_logprob_bytes_rebuild_split_characters(client):
    """Emoji come as 3-4 tokens, each decoding alone to U+FFFD: their ``bytes`` are the
    character's own pieces, so joined they are the reply's UTF-8 (streamed or not)."""
    ask = [{"role": "user", "content": "Write three fox emojis."}]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ask, temperature=0, max_tokens=12, logprobs=True, stream=stream
        )
        if stream:
            choices = [c.choices[0] for c in response if c.choices]
            content = [e for c in choices if c.logprobs for e in c.logprobs.content]
            reply = "".join(c.delta.content or "" for c in choices)
        else:
            content = response.choices[0].logprobs.content
            reply = response.choices[0].message.content
        assert sum(e.token == "\ufffd" for e in content) >= 3  # the split characters
        assert bytes(b for e in content for b in e.bytes).decode() == reply
        assert "\ufffd" not in reply


def test_chat_logprobs_greedy(client):
    response = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert all(isinstance(entry, ChatCompletionTokenLogprob) for entry in content)
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 5 and entry.logprob <= 0
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
        assert entry.token == entry.top_logprobs[0].token
        if "\ufffd" not in entry.token:  # else the bytes of part of a character
            assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    if choice.finish_reason == "length":
        assert "".join(e.token for e in content) == choice.message.content
        assert bytes(b for e in content for b in e.bytes).decode() == choice.message.content
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=5,
        stream=True,
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    # the second request reuses the first one's cached prompt blocks, so float32 sums may differ in
    # the last bits: tokens are equal, logprobs within 1e-4
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_chat_logprobs_without_top(client):
    response = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0.8, seed=3, max_tokens=4, logprobs=True
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    plain = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0.8, seed=3, max_tokens=4
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == response.choices[0].message.content


def test_completion_logprobs_greedy(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=3
    )
    choice = response.choices[0]
    assert isinstance(choice.logprobs, Logprobs)
    lp = choice.logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value == max(top.values()) and top[token] == value
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert "".join(lp.tokens) == choice.text


def test_echo_with_max_tokens_zero_gives_prompt_logprobs(server, client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    choice = response.choices[0]
    ids = tokenize(server, PROMPT)
    assert choice.text == PROMPT and response.usage.completion_tokens == 0
    lp = choice.logprobs
    assert (
        "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids) == response.usage.prompt_tokens
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(
        len(top) in (2, 3) and top[t] == v
        for t, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])
    )


def test_prompt_logprobs_match_the_sampled_ones(server, client):
    """Greedy logprobs are those of the model's distribution (T=1): scoring the same tokens as a
    prompt (prefill positions) must give the same numbers as generating them (decode steps)."""
    generated = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=1
    )
    lp = generated.choices[0].logprobs
    ids = tokenize(server, PROMPT)
    new_ids = tokenize(server, generated.choices[0].text, add_special_tokens=False)
    assert len(new_ids) == 6
    echoed = post(
        server,
        "v1/completions",
        {"prompt": ids + new_ids, "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    scored = echoed.json()["choices"][0]["logprobs"]["token_logprobs"][len(ids) :]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(scored, lp.token_logprobs)), (
        scored,
        lp.token_logprobs,
    )


def test_echo_with_generation(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, echo=True, logprobs=0
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == echoed.usage.prompt_tokens + 4 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[-1] == len(echoed.choices[0].text) - len(lp.tokens[-1])
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


# --- n, seed, usage ---------------------------------------------------------------------------


def test_n3_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=CAPITAL, n=3, temperature=1.0, seed=11, max_tokens=6)
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    # usage counts every choice's tokens (their logprobs entries: one per token)
    counted = client.chat.completions.create(logprobs=True, **kwargs)
    assert [c.message.content for c in counted.choices] == [c.message.content for c in full.choices]
    lengths = [len(c.logprobs.content) for c in counted.choices]
    assert full.usage.completion_tokens == sum(lengths) and all(0 < n <= 6 for n in lengths)
    texts, finishes = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert len(set(texts.values())) > 1  # independent samples
    single = client.chat.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].message.content == texts[0]  # child i samples with seed + i


def test_completion_n3(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, temperature=1.0, max_tokens=4, seed=5, logprobs=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)
    assert response.usage.prompt_tokens == 5
    texts, finishes = ["", "", ""], [[], [], []]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, temperature=1.0, max_tokens=4, seed=5, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == [c.text for c in response.choices]
    assert finishes == [[c.finish_reason] for c in response.choices]


def test_seed_reproducible_alone_and_in_a_mixed_batch(client):
    seeded = dict(
        model=MODEL,
        prompt="Once upon a time",
        temperature=1.0,
        top_p=0.95,
        seed=1234,
        max_tokens=12,
    )
    alone = client.completions.create(**seeded).choices[0].text

    def run(i: int) -> str:
        if i == 7:
            return client.completions.create(**seeded).choices[0].text
        extra = [
            dict(temperature=0),
            dict(temperature=0.7, extra_body={"top_k": 20}),
            dict(temperature=1.2, presence_penalty=1.0),
            dict(temperature=1.0, n=2),
            dict(temperature=0.9, logprobs=2),
            dict(temperature=1.0, seed=i),
        ][i % 6]
        return (
            client.completions.create(
                model=MODEL, prompt=f"Story number {i}:", max_tokens=4 + i % 9, **extra
            )
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, range(16)))
    assert texts[7] == alone


def _stream_lines(server: RemoteServer, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", server.url_for(path), json={"model": MODEL, **body}, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(
    "path, body",
    [
        ("v1/chat/completions", {"messages": CAPITAL}),
        ("v1/completions", {"prompt": PROMPT}),
    ],
)
def test_include_usage_on_and_off(server, path, body):
    base = {**body, "stream": True, "max_tokens": 5, "temperature": 0}
    without = _stream_lines(server, path, base)
    assert all("usage" not in c and c["choices"] for c in without)
    with_usage = _stream_lines(server, path, {**base, "stream_options": {"include_usage": True}})
    last = with_usage[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert all("usage" not in c for c in with_usage[:-1])


# --- penalties, bias, min_tokens, stop strings --------------------------------------------------


def test_logit_bias_and_min_tokens_with_a_stop_token(client):
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, logit_bias={str(THE): 100})
    forced = client.completions.create(**body, extra_body={"stop_token_ids": [THE]})
    assert forced.usage.completion_tokens == 1 and forced.choices[0].finish_reason == "stop"
    held = client.completions.create(**body, extra_body={"stop_token_ids": [THE], "min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].stop_reason == THE
    free = client.completions.create(**body)
    assert free.choices[0].text == " the" * 8


def test_min_tokens_holds_back_eos_and_special_tokens_show_when_asked(client):
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, logit_bias={str(EOS): 100})
    shown = client.completions.create(
        **body,
        extra_body={
            "min_tokens": 2,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        },
    )
    assert shown.usage.completion_tokens == 3 and shown.choices[0].finish_reason == "stop"
    assert shown.choices[0].text.endswith("<|im_end|>")
    hidden = client.completions.create(**body, extra_body={"min_tokens": 2})
    assert hidden.usage.completion_tokens == 3 and "<|im_end|>" not in hidden.choices[0].text


def test_include_stop_str_in_output(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=16,
        stop=["Paris"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert response.choices[0].message.content.endswith("Paris")
    assert response.choices[0].finish_reason == "stop"


def test_penalties_lower_repeated_tokens(client):
    """A penalty either changes the greedy text or, where the text stays, lowers the logprob of
    every token already generated (logprobs are of the penalized distribution)."""
    body = dict(
        model=MODEL, prompt="one one one one one one", temperature=0, max_tokens=8, logprobs=0
    )
    plain = client.completions.create(**body).choices[0].logprobs
    repeats = [j for j, t in enumerate(plain.tokens) if t in plain.tokens[:j]]
    assert repeats  # greedy repeats itself here
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 3.0}},
    ):
        penalized = client.completions.create(**body, **extra).choices[0].logprobs
        if penalized.tokens == plain.tokens:
            assert all(
                penalized.token_logprobs[j] < plain.token_logprobs[j] - 1e-3 for j in repeats
            ), extra
        else:
            assert any(a != b for a, b in zip(penalized.tokens, plain.tokens)), extra


def test_max_tokens_null_runs_to_the_context_limit(server):
    response = post(
        server, "v1/completions", {"prompt": [THE] * 505, "max_tokens": None, "ignore_eos": True}
    )
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 505, "completion_tokens": 7, "total_tokens": 512}


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 0),
        ("top_p", 1.5),
        ("temperature", -0.5),
        ("n", 0),
        ("top_logprobs", 21),
        ("logit_bias", {"5": 150}),
        ("logit_bias", {"99999999": 1}),
        ("logit_bias", {"x": 1}),
        ("presence_penalty", 2.5),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("min_tokens", -1),
        ("max_completion_tokens", 0),
    ],
)
def test_invalid_chat_values_name_the_field(server, field, value):
    body = {"messages": CAPITAL, "max_tokens": 2, "logprobs": True, field: value}
    response = post(server, "v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "body, field",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0, "stream": True}, "n"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ],
)
def test_invalid_completion_values_name_the_field(server, body, field):
    response = post(server, "v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=2, top_logprobs=3)
    assert info.value.body["param"] == "top_logprobs"


# --- tokenizer routes and version ------------------------------------------------------------


def test_tokenize_and_detokenize(server, client):
    body = httpx.post(server.url_for("tokenize"), json={"model": MODEL, "prompt": PROMPT}).json()
    ids = body["tokens"]
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids} and len(ids) > 3
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == PROMPT and by_ids.usage.prompt_tokens == len(ids)
    strs = httpx.post(
        server.url_for("tokenize"), json={"prompt": PROMPT, "return_token_strs": True}
    ).json()
    assert (
        strs["token_strs"][1] == "Ġcapital"
    )  # byte-level BPE strings, as the vocabulary spells them
    assert httpx.post(server.url_for("detokenize"), json={"tokens": ids}).json() == {
        "prompt": PROMPT
    }
    chat = httpx.post(server.url_for("tokenize"), json={"messages": CAPITAL}).json()
    usage = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])
    bad = httpx.post(server.url_for("detokenize"), json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenizer_info_is_the_tokenizer_config_without_server_paths(server, hf_gguf_tokenizer):
    info = httpx.get(server.url_for("tokenizer_info")).json()
    assert info["tokenizer_class"] and info["model_max_length"] == 512
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert info["chat_template"] == hf_gguf_tokenizer.chat_template
    assert not {"name_or_path", "vocab_file"} & set(info)


def test_tokenizer_info_is_off_without_its_flag():
    response = stub_app_client().get("/tokenizer_info")
    assert response.status_code == 404
    assert "--enable-tokenizer-info-endpoint" in response.json()["error"]["message"]


def test_version(server):
    body = httpx.get(server.url_for("version")).json()
    assert set(body) == {"version"} and body["version"]


@pytest.mark.parametrize(
    "path, body, message",
    [
        (  # every member of the union failed at its top: the value and the members
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "messages[0].content: 5 is none of the accepted types (str, list[ChatContentPart])",
        ),
        (  # a list of parts whose part is wrong: that part's field, no union member in it
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            },
            "messages[0].content[0].text: Input should be a valid string",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": 5},
            "prompt: 5 is none of the accepted types (str, list[str], list[int], list[list[int]])",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": [[1, "a"]]},
            "prompt[0][1]: Input should be a valid integer",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"content": "hi"}]},
            "messages[0].role: Field required",
        ),
    ],
)
def test_a_malformed_field_is_named_by_its_path(path, body, message):
    """A validation error names the field as the request wrote it: pydantic's names of union
    members (``content.str``) are not part of it."""
    response = stub_app_client().post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == next(iter(body.keys() - {"model"}))


def test_a_route_a_flag_adds_names_the_flag_in_its_404():
    """vLLM's adapter routes exist with --allow-runtime-lora-updating only; without it the 404
    says so (it was a bare "no route")."""
    client = stub_app_client()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = client.post(path, json={"lora_name": "a", "lora_path": "/x"})
        assert response.status_code == 404
        assert response.json()["error"]["message"] == (
            f"no route for POST {path} (a server started with --enable-lora "
            "--allow-runtime-lora-updating answers it)"
        )
    assert client.get("/v1/nothing").json()["error"]["message"] == "no route for GET /v1/nothing"


def test_a_body_that_is_not_json_says_where_it_breaks():
    client = stub_app_client()
    for body, message in [
        (b'{"model": "m", "prompt": "abc', "Unterminated string starting at (character 25)"),
        (b'{"model": }', "Expecting value (character 10)"),
    ]:
        response = client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            f"the request body is not valid JSON: {message}"
        )
