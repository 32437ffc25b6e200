"""``--reasoning-parser qwen3``: the ``<think>`` parser on scripted text and token streams, and
through a real ``pyxllm serve`` on a tiny random Qwen3 checkpoint whose tokenizer has
``<think>``/``</think>`` tokens and a chat template with ``enable_thinking``."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import httpx
import pytest
import torch

from pyxllm.cli.main import parse_args
from pyxllm.engine.detokenizer import IncrementalDetokenizer
from pyxllm.engine.input_processor import InputProcessor
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.entrypoints.openai.chat.reasoning import (
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_reasoning_parser,
)
from pyxllm.entrypoints.openai.chat.reasoning.think_tags import (
    ThinkTagReasoningParser,
    partial_tag_len,
)
from pyxllm.entrypoints.openai.chat.serving import OpenAIServingChat
from pyxllm.entrypoints.openai.protocol import ChatCompletionRequest
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.sampling_params import SamplingParams
from tests.model_fixtures import build_hf_model, save_checkpoint, thinking_tokenizer, tiny_config
from tests.utils import RemoteServer

# (generated text, expected reasoning_content, expected content)
CASES = [
    ("<think>\nplan</think>\n\nanswer", "\nplan", "\n\nanswer"),
    ("plan</think>answer", "plan", "answer"),  # the template opened the block
    ("plan only", "plan only", None),  # cut off by max_tokens
    ("<think>plan", "plan", None),
    ("</think>answer", None, "answer"),
    ("plan</think>", "plan", None),
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first </think> closes
    ("x<think>y</think>z", "x<think>y", "z"),  # only a leading <think> is a tag
    ("<think></think>", None, None),
    ("", None, None),
    ("<thi", "<thi", None),  # a partial tag at the very end is text
    ("ab</thi", "ab</thi", None),
    ("a<</think>>b", "a<", ">b"),
    ("<<think>a", "<<think>a", None),
]


class TextTokenizer:
    """Just enough of a tokenizer for the parser's constructor (tags are plain text)."""

    def encode(self, text, add_special_tokens=False):
        return list(text)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ids)


@pytest.fixture(scope="module")
def parser():
    return ThinkTagReasoningParser(TextTokenizer())


def stream(parser, pieces: list[str]) -> tuple[list[str], list[str]]:
    """Feed ``pieces`` as successive deltas; the reasoning and content deltas, in order."""
    reasoning, content, text = [], [], ""
    for i, piece in enumerate(pieces):
        delta = parser.extract_reasoning_streaming(text, text + piece, i == len(pieces) - 1)
        text += piece
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    return reasoning, content


# --- the parser on scripted text ------------------------------------------------------------


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_extract_reasoning(parser, text, reasoning, content):
    assert parser.extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_streaming_split_anywhere_matches_whole(parser, text, reasoning, content):
    """Every split of the text into 1, 2 or 3 deltas (and one delta per character, and an empty
    last delta, as when the final output adds no text) concatenates to the whole-text fields."""
    n = len(text)
    splits = [[text], list(text), [text, ""]]
    splits += [[text[:i], text[i:]] for i in range(n + 1)]
    splits += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(n + 1), 2)]
    for pieces in splits:
        r, c = stream(parser, pieces)
        assert ("".join(r), "".join(c)) == (reasoning or "", content or ""), pieces


def test_end_tag_split_across_deltas_is_held_back(parser):
    r, c = stream(parser, ["<think>ab</th", "ink>cd", "e"])
    assert (r, c) == (["ab", "", ""], ["", "cd", "e"])
    r, c = stream(parser, ["ab<", "/", "think", ">", "cd"])
    assert (r, c) == (["ab", "", "", "", ""], ["", "", "", "", "cd"])
    # a held-back prefix that turns out not to be the tag is reasoning after all
    r, c = stream(parser, ["ab</th", "x", "</think>"])
    assert (r, c) == (["ab", "</thx", ""], ["", "", ""])
    # the stream ends inside a would-be tag: the held text is released at the end
    r, c = stream(parser, ["<th", "ab</thi", ""])
    assert (r, c) == (["", "<thab", "</thi"], ["", "", ""])


def test_partial_tag_len():
    assert partial_tag_len("abc</thi", "</think>") == 5
    assert partial_tag_len("abc<", "</think>") == 1
    assert partial_tag_len("abc</think>", "</think>") == 0  # a whole tag is not partial
    assert partial_tag_len("", "</think>") == 0


# --- the parser with real tokenizers --------------------------------------------------------


@pytest.fixture(scope="module")
def think_tok(hf_gguf_tokenizer):
    """The SmolLM2 tokenizer with <think>/</think> added tokens and a Qwen3-like template."""
    return thinking_tokenizer(hf_gguf_tokenizer)


SCRIPT = "<think>\nThe sky scatters blue light.\n</think>\n\nRayleigh scattering, ça va ✓."


@pytest.mark.parametrize("which", ["think_tokens", "plain_bpe"])
def test_scripted_token_stream(which, think_tok, hf_gguf_tokenizer):
    """A token stream through the engine's incremental detokenizer: with added think tokens one
    token is a whole tag; with plain BPE ``</think>`` spans '</', 'think', '>'."""
    hf = think_tok if which == "think_tokens" else hf_gguf_tokenizer
    tokenizer = Tokenizer(hf)
    parser = ThinkTagReasoningParser(tokenizer)
    token_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    pieces = hf.convert_ids_to_tokens(token_ids)
    if which == "think_tokens":
        assert "</think>" in pieces
    else:
        assert "</think>" not in pieces and "</" in pieces
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
    deltas, text = [], ""
    for i, token_id in enumerate(token_ids):
        detok.update([token_id])
        last = i == len(token_ids) - 1
        current = detok.finish() if last else detok.output_text
        deltas.append(parser.extract_reasoning_streaming(text, current, last))
        text = current
    assert text == SCRIPT
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    assert reasoning == "\nThe sky scatters blue light.\n"
    assert content == "\n\nRayleigh scattering, ça va ✓."
    assert not any("<" in d.reasoning or "<" in d.content for d in deltas)


def test_prompt_decides_whether_reasoning_ended(think_tok):
    parser = ThinkTagReasoningParser(Tokenizer(think_tok))
    messages = [{"role": "user", "content": "Why is the sky blue?"}]

    def prompt(msgs, **kwargs):
        return Tokenizer(think_tok).apply_chat_template(msgs, **kwargs)

    assert parser.is_reasoning_end(prompt(messages, enable_thinking=False))
    assert not parser.is_reasoning_end(prompt(messages))
    assert not parser.is_reasoning_end(prompt(messages, enable_thinking=True))
    history = [
        *messages,
        {"role": "assistant", "content": "<think>hm</think>Rayleigh."},
        {"role": "user", "content": "And at sunset?"},
    ]
    assert not parser.is_reasoning_end(prompt(history))  # an earlier turn's block is history
    assert parser.is_reasoning_end(prompt(history, enable_thinking=False))


def test_special_think_tags_keep_special_tokens(hf_gguf_tokenizer, think_tok):
    """Tags that decoding would drop make reasoning requests keep special tokens, unless the
    request chose; non-special tags (Qwen3's) leave the request as it is."""
    special_tok = thinking_tokenizer(hf_gguf_tokenizer, special=True)
    cases = [(think_tok, None, True), (special_tok, None, False), (special_tok, True, True)]
    for hf, requested, expected in cases:
        chat = OpenAIServingChat(
            fake_engine(Tokenizer(hf)), ServerOptions(reasoning_parser="qwen3")
        )
        assert chat.reasoning_parser.needs_special_tokens == (hf is special_tok)
        request = ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], skip_special_tokens=requested
        )
        fields = {} if requested is None else {"skip_special_tokens": requested}
        parser, needed = chat.request_reasoning(request, rendered(chat, request))
        assert parser is chat.reasoning_parser
        assert SamplingParams(**fields, **needed).skip_special_tokens == expected
    off = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert chat.request_reasoning(off, rendered(chat, off)) == (None, {})


def fake_engine(tokenizer: Tokenizer) -> SimpleNamespace:
    """What the chat handler reads of an engine, without a model."""
    processor = InputProcessor(
        tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=64, max_kv_blocks=4, block_size=16
    )
    return SimpleNamespace(
        model_name="m",
        served_model_names=("m",),
        max_model_len=64,
        max_num_seqs=4,
        task="generate",
        tokenizer=tokenizer,
        input_processor=processor,
    )


def rendered(chat: OpenAIServingChat, request: ChatCompletionRequest) -> list[int]:
    """The prompt token ids the handler renders for ``request``."""
    return list(chat.processor.tokenize(chat.chat_prompt(request)).token_ids)


def test_registry_and_flag(capsys):
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())
    assert get_reasoning_parser("qwen3") is ThinkTagReasoningParser
    assert get_reasoning_parser("deepseek_r1") is ThinkTagReasoningParser
    with pytest.raises(
        ValueError, match="known parsers: deepseek_r1, gpt_oss, granite, openai_gptoss, qwen3"
    ):
        get_reasoning_parser("nope")
    args, _ = parse_args(["serve", "--reasoning_parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"
    assert parse_args(["serve"])[0].reasoning_parser is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--reasoning-parser", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'qwen3'" in err and "'deepseek_r1'" in err


GRANITE_CASES = [
    ("Here is my thought process:\nplan\nHere is my response:\nanswer", "\nplan\n", "\nanswer"),
    ("Here's my thought process: a Here's my response: b", " a ", " b"),
    ("  Here is my thought process: cut off", " cut off", None),  # max_tokens
    ("The answer is 4.", None, "The answer is 4."),  # no thinking at all
    ("Here is my answer.", None, "Here is my answer."),  # diverges from the phrase
    ("Here is my thought process:x Here is my respo", "x Here is my respo", None),
    ("Here is my thought process:Here is my response:", None, None),
    ("Here", None, "Here"),  # the final text releases a would-be phrase
    ("", None, None),
]


@pytest.mark.parametrize("text,reasoning,content", GRANITE_CASES)
def test_granite_phrases_split_whole_and_streamed_alike(text, reasoning, content):
    """Granite 3.2's phrases: the whole text, and its deltas split anywhere (one character at
    a time, in two pieces at every point), give the same fields."""
    parser = get_reasoning_parser("granite")(TextTokenizer())
    assert parser.extract_reasoning(text) == (reasoning, content)
    for pieces in [list(text), [text, ""], *([text[:i], text[i:]] for i in range(len(text)))]:
        r, c = stream(parser, pieces)
        assert ("".join(r), "".join(c)) == (reasoning or "", content or ""), pieces


def test_granite_counts_the_tokens_up_to_its_response_phrase():
    parser = get_reasoning_parser("granite")(TextTokenizer())
    text = "Here is my thought process: ab Here is my response: cd"
    assert parser.count_reasoning_tokens(list(text)) == len(text) - len(" cd")
    assert parser.count_reasoning_tokens(list("no thinking")) == 0
    assert parser.count_reasoning_tokens(list("Here is my thought process: ab")) == 30


def test_auto_takes_the_parser_the_chat_template_names(capsys):
    assert resolve_reasoning_parser("auto", "{{ '<think>' }}") == "qwen3"
    assert resolve_reasoning_parser("auto", "<|start|>{{ '<|channel|>analysis' }}") == "gpt_oss"
    granite = "Write your thoughts after 'Here is my thought process:' ..."
    assert resolve_reasoning_parser("auto", granite) == "granite"
    assert resolve_reasoning_parser("auto", "{{ messages }}") is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("qwen3", granite) == "qwen3"
    assert parse_args(["serve", "--reasoning-parser", "auto"])[0].reasoning_parser == "auto"


# --- through the server ---------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
CLOSE_AT_MOST = 8  # </think> comes within the first tokens of the greedy continuation
NEW_TOKENS = 14


def greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of ``ids`` (EOS ignored)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory, think_tok):
    """A tiny random Qwen3 whose greedy reply to MESSAGES closes the think block once, at
    token ``k``: the ``</think>`` row of lm_head is a scaled copy of the row of the token the
    untouched model picks at step ``k`` (the first ``k`` that yields exactly one ``</think>``)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_hf_model(tiny_config("qwen3", vocab_size=len(think_tok)), seed=0)
        end_id = think_tok.convert_tokens_to_ids("</think>")
        prompt = Tokenizer(think_tok).apply_chat_template(MESSAGES)
        plain = greedy(model, prompt)
        with torch.no_grad():
            for k in range(3, CLOSE_AT_MOST):
                model.lm_head.weight[end_id] = 1.5 * model.lm_head.weight[plain[k]]
                out = greedy(model, prompt)
                if out.count(end_id) == 1 and out.index(end_id) == k:
                    break
            else:
                pytest.fail("no lm_head tweak closes the think block once")
        directory = save_checkpoint(model, tmp_path_factory.mktemp("qwen3_think"), think_tok)
    finally:
        torch.set_num_threads(saved)
    prompt_off = Tokenizer(think_tok).apply_chat_template(MESSAGES, enable_thinking=False)
    return SimpleNamespace(
        dir=directory,
        close_at=k,
        prompt=prompt,
        prompt_off=prompt_off,
        greedy_ids=out,
        end_id=end_id,
    )


@pytest.fixture(scope="module")
def server(thinking_checkpoint):
    args = [
        "--model",
        str(thinking_checkpoint.dir),
        "--reasoning-parser",
        "auto",  # the <think> tags of the chat template: qwen3's parser (the log says so)
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "0.05",
        "--dtype",
        "float32",
    ]
    with RemoteServer(args, env={"OMP_NUM_THREADS": "1"}) as remote:
        yield remote


def raw_text(server, prompt_ids: list[int], max_tokens: int) -> str:
    """The greedy text of ``prompt_ids`` through /v1/completions (no reasoning parsing)."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url_for("v1", "completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def chat(server, max_tokens: int, stream: bool, **extra):
    body = {
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    if not stream:
        response = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()
    chunks = []
    with httpx.stream(
        "POST", server.url_for("v1", "chat", "completions"), json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def streamed(chunks) -> tuple[str, str, str]:
    """``(reasoning, content, finish_reason)`` of stream chunks; each delta's ``reasoning``
    equals its ``reasoning_content``."""
    reasoning, content, finish = "", "", None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content"), delta
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_server_auto_chose_the_think_tag_parser(server):
    assert "--reasoning-parser auto: qwen3" in server.output()


def test_server_thinking_closed(server, thinking_checkpoint):
    """The model writes </think> mid-way: reasoning before it, content after it."""
    text = raw_text(server, thinking_checkpoint.prompt, NEW_TOKENS)
    assert text.count("</think>") == 1 and not text.startswith("</think>")
    reasoning, content = text.split("</think>")
    assert content  # tokens follow the tag
    body = chat(server, NEW_TOKENS, stream=False)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert message["reasoning"] == reasoning
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(thinking_checkpoint.prompt)
    chunks = chat(server, NEW_TOKENS, stream=True)
    assert streamed(chunks) == (reasoning, content, "length")
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    kinds = [("reasoning_content" in d, "content" in d) for d in deltas]
    assert kinds.index((False, True)) > 0 and (True, False) in kinds  # both fields streamed


def test_server_thinking_truncated(server, thinking_checkpoint):
    """max_tokens ends generation before </think>: all text is reasoning, content is null."""
    max_tokens = thinking_checkpoint.close_at
    text = raw_text(server, thinking_checkpoint.prompt, max_tokens)
    assert text and "</think>" not in text
    body = chat(server, max_tokens, stream=False)
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == choice["message"]["reasoning"] == text
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "length"
    assert streamed(chat(server, max_tokens, stream=True)) == (text, "", "length")


def test_server_thinking_off(server, thinking_checkpoint):
    """enable_thinking=false reaches the template (the prompt is longer), which closes the block
    in the prompt: all generated text is content, none is reasoning."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    text = raw_text(server, thinking_checkpoint.prompt_off, NEW_TOKENS)
    assert text
    body = chat(server, NEW_TOKENS, stream=False, **off)
    assert body["usage"]["prompt_tokens"] == len(thinking_checkpoint.prompt_off)
    message = body["choices"][0]["message"]
    assert message["content"] == text
    assert message["reasoning_content"] is None and message["reasoning"] is None
    assert streamed(chat(server, NEW_TOKENS, stream=True, **off)) == ("", text, "length")


def test_server_openai_sdk_sees_reasoning(server, thinking_checkpoint):
    """The ``openai`` SDK exposes the extension fields on the message."""
    client = server.openai_client()
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    message = response.choices[0].message
    assert message.reasoning_content and message.content is None
    assert message.reasoning_content == raw_text(server, thinking_checkpoint.prompt, 3)


def test_a_constraint_applies_to_the_answer_not_the_reasoning(server, thinking_checkpoint):
    """With --reasoning-parser the model thinks freely (the same reasoning as unconstrained),
    and the constraint holds from ``</think>`` on; with thinking off, from the first token."""
    text = raw_text(server, thinking_checkpoint.prompt, NEW_TOKENS)
    reasoning = text.split("</think>")[0]
    regex = {"structured_outputs": {"regex": "[a-z]{3}"}}
    message = chat(server, NEW_TOKENS, stream=False, **regex)["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning
    assert re.fullmatch("[a-z]{3}", message["content"]), message
    assert streamed(chat(server, NEW_TOKENS, stream=True, **regex))[:2] == (
        reasoning,
        message["content"],
    )
    off = {"chat_template_kwargs": {"enable_thinking": False}, **regex}
    message = chat(server, NEW_TOKENS, stream=False, **off)["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3}", message["content"]) and message["reasoning_content"] is None


def test_responses_api_gives_a_reasoning_item(server, thinking_checkpoint):
    """The Responses API: a ``reasoning`` item holding chat's ``reasoning_content``, then a
    message with its ``content``, streamed or not; ``reasoning_tokens`` count the output up to
    and with ``</think>``. A later turn sent with the reasoning item renders as chat's
    assistant turn with ``reasoning_content``."""
    client = server.openai_client()
    ask = {"model": client.models.list().data[0].id, "input": MESSAGES, "temperature": 0}
    body = {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0}
    reference = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
    message = reference.json()["choices"][0]["message"]
    response = client.responses.create(**ask, max_output_tokens=NEW_TOKENS)
    reasoning, *rest = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == message["reasoning_content"] and reasoning.summary == []
    assert message["content"] and response.output_text == message["content"]
    assert [item.type for item in rest] == ["message"]
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == thinking_checkpoint.close_at + 1
    with client.responses.stream(**ask, max_output_tokens=NEW_TOKENS) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == message["reasoning_content"]
    final = events[-1].response
    strip = {"id"}
    assert [i.model_dump(exclude=strip) for i in final.output] == [
        i.model_dump(exclude=strip) for i in response.output
    ]
    assert final.usage == response.usage
    # sent back, the reasoning item is the assistant turn's reasoning_content
    turns = [*MESSAGES, {"role": "assistant", "content": message["content"]}]
    turns[-1]["reasoning_content"] = message["reasoning_content"]
    turns.append({"role": "user", "content": "Thanks."})
    body = {"messages": turns, "max_tokens": 3, "temperature": 0}
    reference = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
    items = [*MESSAGES, *[i.model_dump(exclude_none=True) for i in response.output]]
    items.append({"role": "user", "content": "Thanks."})
    again = client.responses.create(**{**ask, "input": items}, max_output_tokens=3)
    assert again.usage.input_tokens == reference.json()["usage"]["prompt_tokens"]
    expected = reference.json()["choices"][0]["message"]["reasoning_content"] or ""
    assert "".join(i.content[0].text for i in again.output if i.type == "reasoning") == expected


# --- the thinking budget (thinking_token_budget, reasoning.effort) ----------------------------


def chat_usage(server, max_tokens: int, stream: bool, **extra) -> dict:
    """The usage of a chat request (streamed: its last chunk's, with include_usage)."""
    if not stream:
        return chat(server, max_tokens, False, **extra)["usage"]
    chunks = chat(server, max_tokens, True, stream_options={"include_usage": True}, **extra)
    return chunks[-1]["usage"]


@pytest.mark.parametrize("budget", [0, 2])
def test_thinking_budget_forces_the_end_of_thinking(server, thinking_checkpoint, budget):
    """With a budget below where the model closes its thinking, the reasoning is the model's
    first ``budget`` greedy tokens, then ``</think>`` is forced, and the content is the greedy
    continuation of that (the server's own, with the forced tag in the prompt); usage counts
    exactly ``budget + 1`` reasoning tokens, streamed or not."""
    ck = thinking_checkpoint
    assert budget < ck.close_at
    forced = [*ck.greedy_ids[:budget], ck.end_id]
    reasoning = raw_text(server, ck.prompt, budget) if budget else ""
    content = raw_text(server, ck.prompt + forced, NEW_TOKENS - len(forced))
    assert content
    extra = {"thinking_token_budget": budget}
    body = chat(server, NEW_TOKENS, stream=False, **extra)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"] or "", message["content"]) == (reasoning, content)
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": budget + 1}
    assert streamed(chat(server, NEW_TOKENS, stream=True, **extra)) == (
        reasoning,
        content,
        "length",
    )
    assert chat_usage(server, NEW_TOKENS, True, **extra) == body["usage"]


def test_thinking_budget_not_reached_changes_nothing(server, thinking_checkpoint):
    """A budget the model's thinking stays within leaves the reply as it is; the usage's
    reasoning tokens are the output up to and with its own ``</think>``; with thinking off
    (the prompt closed it) the budget has nothing to cut and nothing is split off."""
    free = chat(server, NEW_TOKENS, stream=False)
    budget = thinking_checkpoint.close_at
    limited = chat(server, NEW_TOKENS, stream=False, thinking_token_budget=budget)
    assert limited["choices"] == free["choices"]
    details = {"reasoning_tokens": thinking_checkpoint.close_at + 1}
    assert free["usage"]["completion_tokens_details"] == details
    assert limited["usage"]["completion_tokens_details"] == details
    off = {"chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 0}
    body = chat(server, NEW_TOKENS, stream=False, **off)
    assert body["choices"][0]["message"]["content"] == raw_text(
        server, thinking_checkpoint.prompt_off, NEW_TOKENS
    )
    assert "completion_tokens_details" not in body["usage"]  # nothing was split off


def test_thinking_budget_out_of_range_is_a_400(server):
    body = {"messages": MESSAGES, "max_tokens": 2, "thinking_token_budget": -1}
    response = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_token_budget"


def test_responses_reasoning_effort_is_a_budget(server, thinking_checkpoint):
    """``reasoning.effort`` is accepted and echoed; its budget (low: 1024 tokens) is above what
    this model thinks, so the reply is chat's."""
    client = server.openai_client()
    model = client.models.list().data[0].id
    plain = client.responses.create(
        model=model, input=MESSAGES, temperature=0, max_output_tokens=NEW_TOKENS
    )
    low = client.responses.create(
        model=model,
        input=MESSAGES,
        temperature=0,
        max_output_tokens=NEW_TOKENS,
        reasoning={"effort": "low"},
    )
    assert low.reasoning.effort == "low" and plain.reasoning.effort is None
    assert low.output_text == plain.output_text
    assert low.usage == plain.usage
