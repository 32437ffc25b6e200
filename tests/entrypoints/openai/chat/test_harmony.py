"""gpt-oss's harmony format: ``--reasoning-parser openai_gptoss`` (the analysis channel is the
reasoning, the final channel the content) and ``--tool-call-parser openai`` (calls on the
commentary channel), on scripted texts fed whole and in every piece size, alone and one after
the other as the chat handler runs them, and through a token stream of a tokenizer with
harmony's special tokens; then through ``pyxllm serve`` with a harmony chat template. (The
``openai`` parser's recorded texts are in test_tool_calls.py.)"""

from __future__ import annotations

import re

import pytest

from pyxllm.engine.detokenizer import IncrementalDetokenizer
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.entrypoints.openai.chat.harmony import parse_messages
from pyxllm.entrypoints.openai.chat.reasoning import get_reasoning_parser
from pyxllm.entrypoints.openai.chat.reasoning.gpt_oss import GptOssReasoningParser
from pyxllm.entrypoints.openai.chat.tool_parsers import (
    ToolCallStream,
    get_tool_parser,
    split_tool_calls,
)
from pyxllm.entrypoints.openai.chat.tool_parsers.gpt_oss import OpenAIToolParser
from tests.entrypoints.openai.chat.test_reasoning import TextTokenizer, stream
from tests.entrypoints.openai.chat.test_tool_calls import TOOLS, assemble, streamed
from tests.entrypoints.openai.chat.test_tool_choice_auto import GPT_OSS_STYLE, SERVER_ARGS, chat
from tests.utils import RemoteServer, run_together

TOOLS_WEATHER = TOOLS[0]
HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)

# (generated text, reasoning_content, content): what the reasoning parser splits
CASES = [
    (
        f"{ANALYSIS}The user wants a greeting.{NEXT}<|channel|>final<|message|>"
        "Hello, ça va ✓<|return|>",
        "The user wants a greeting.",
        "Hello, ça va ✓",
    ),
    (f"{ANALYSIS}Cut off by max_tok", "Cut off by max_tok", None),
    (
        f"{ANALYSIS}a{NEXT}<|channel|>analysis<|message|>b{NEXT}<|channel|>final<|message|>c",
        "a\nb",
        "c",
    ),
    ("<|channel|>final<|message|>No reasoning.", None, "No reasoning."),
    ("Plain text, no harmony.", None, "Plain text, no harmony."),
    (f"{ANALYSIS}x{NEXT}<|chan", "x", None),  # a header cut short: nothing of it shown
    ("a <|b|> c", None, "a <|b|> c"),  # <| that begins no token is text
    (f"{ANALYSIS}Need the weather.<|end|>{CALL}", "Need the weather.", CALL),  # kept for tools
    (
        f"{ANALYSIS}Check.{NEXT}<|channel|>commentary<|message|>Checking.{NEXT} "
        'to=functions.get_time<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
        "Check.",
        "Checking.<|start|>assistant to=functions.get_time<|channel|>commentary json"
        '<|message|>{"city": "Oslo"}<|call|>',
    ),  # a preamble (commentary with no recipient) is content
    ("", None, None),
]
# What the tool parser then finds in the content: (content, calls)
CALLS = {
    7: (None, [("get_weather", '{"city": "Paris"}')]),
    8: ("Checking.", [("get_time", '{"city": "Oslo"}')]),
}


@pytest.fixture(scope="module")
def reasoning():
    return GptOssReasoningParser(TextTokenizer())


def test_registered_under_vllms_names():
    assert get_reasoning_parser("openai_gptoss") is GptOssReasoningParser
    assert get_reasoning_parser("gpt_oss") is GptOssReasoningParser
    assert get_tool_parser("openai") is OpenAIToolParser


@pytest.mark.parametrize("text, expected_reasoning, expected_content", CASES)
def test_reasoning_is_the_analysis_channel_however_the_text_arrives(
    reasoning, text, expected_reasoning, expected_content
):
    assert reasoning.extract_reasoning(text) == (expected_reasoning, expected_content)
    splits = [[text], list(text), [text, ""]] + [[text[:i], text[i:]] for i in range(len(text))]
    for pieces in splits:
        r, c = stream(reasoning, pieces)
        assert ("".join(r), "".join(c)) == (expected_reasoning or "", expected_content or "")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reasoning_then_tools_stream_as_the_whole_text_splits(reasoning, case):
    """The chat handler's order: the reasoning parser's content deltas feed the tool parser,
    one character at a time, and give the calls and content of the whole text."""
    text = CASES[case][0]
    _, content = reasoning.extract_reasoning(text)
    whole_content, calls = split_tool_calls(OpenAIToolParser(), content or "")
    whole = (whole_content, [(c.function.name, c.function.arguments) for c in calls])
    assert whole == CALLS.get(case, (CASES[case][2], []))
    tools, sent, got_content, got_calls = ToolCallStream(OpenAIToolParser()), "", "", {}
    pieces = [text[: k + 1] for k in range(len(text))] or [""]
    for k, current in enumerate(pieces):
        last = k == len(pieces) - 1
        delta = reasoning.extract_reasoning_streaming(pieces[k - 1] if k else "", current, last)
        sent += delta.content
        piece, deltas = tools.update(sent, last)
        got_content += piece
        for d in deltas:
            entry = got_calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    assert (got_content or None, [tuple(v) for v in got_calls.values()]) == whole


def test_tool_parser_alone_leaves_analysis_and_headers_out_of_content():
    """Without the reasoning parser the tool parser reads the whole reply: its analysis is not
    content, with a call or without one."""
    parser = OpenAIToolParser()
    answer = f"{ANALYSIS}Think.{NEXT}<|channel|>final<|message|>Sunny.<|return|>"
    assert split_tool_calls(parser, answer) == ("Sunny.", [])
    assert streamed(parser, [answer[: k + 1] for k in range(len(answer))]) == ("Sunny.", [])
    content, calls = split_tool_calls(parser, f"{ANALYSIS}Think.<|end|>{CALL}")
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    # a built-in tool's message (to=browser.search) is neither a call nor content
    browse = f"{ANALYSIS}x{NEXT}<|channel|>analysis to=browser.search<|message|>{{}}<|call|>"
    assert split_tool_calls(parser, browse) == (None, [])


def test_reasoning_tokens_are_the_analysis_message(reasoning):
    """usage's reasoning_tokens (one token a character here): the analysis through its
    <|end|>, not a call or an answer after it."""
    count = reasoning.count_reasoning_tokens
    assert count(list(CASES[7][0])) == len(f"{ANALYSIS}Need the weather.<|end|>")
    assert count(list(CASES[1][0])) == len(CASES[1][0])  # never closed
    assert count(list(CASES[3][0])) == 0  # answered at once
    forced = f"garbage{NEXT}<|channel|>final<|message|>"  # a thinking budget's forced end
    assert count(list(forced + "answer")) == len(forced)


def test_messages_show_only_complete_headers():
    assert parse_messages("<|channel|>analysis<|mess", final=False) == []
    (message,) = parse_messages("<|channel|>final<|message|>ab<|re", final=False)
    assert (message.channel, message.closed, message.body_end) == ("final", False, 29)
    (message,) = parse_messages("<|channel|>final<|message|>ab<|re", final=True)
    assert message.body_end == 33  # released at the end: it was text after all


@pytest.fixture(scope="module")
def harmony_tok(hf_gguf_tokenizer):
    """The SmolLM2 tokenizer with harmony's special tokens added as special tokens."""
    import copy

    tok = copy.deepcopy(hf_gguf_tokenizer)
    tok.add_tokens(HARMONY_TOKENS, special_tokens=True)
    return Tokenizer(tok)


def test_a_token_stream_keeps_the_special_tokens_out_of_both_fields(harmony_tok):
    parser = GptOssReasoningParser(harmony_tok)
    assert parser.needs_special_tokens
    assert not GptOssReasoningParser(TextTokenizer()).needs_special_tokens
    assert OpenAIToolParser(harmony_tok).needs_special_tokens
    start = list(parser.start_token_ids())
    assert harmony_tok.decode(start, skip_special_tokens=False) == ANALYSIS
    assert harmony_tok.decode(list(parser.end_token_ids()), skip_special_tokens=False) == (
        "<|end|><|start|>assistant<|channel|>final<|message|>"
    )
    script = CASES[0][0]
    token_ids = harmony_tok.encode(script, add_special_tokens=False)
    prompt = harmony_tok.encode("<|start|>assistant", add_special_tokens=False)
    detok = IncrementalDetokenizer(harmony_tok, prompt, skip_special_tokens=False)
    deltas, text = [], ""
    for i, token_id in enumerate(token_ids):
        detok.update([token_id])
        last = i == len(token_ids) - 1
        current = detok.finish() if last else detok.output_text
        deltas.append(parser.extract_reasoning_streaming(text, current, last))
        text = current
    assert text == script
    assert "".join(d.reasoning for d in deltas) == CASES[0][1]
    assert "".join(d.content for d in deltas) == CASES[0][2]
    assert not any("<|" in d.reasoning or "<|" in d.content for d in deltas)


def test_a_harmony_server_splits_reasoning_and_reads_calls(hf_gguf_tokenizer):
    """``--reasoning-parser openai_gptoss`` with a harmony chat template (so ``auto`` picks the
    ``openai`` tool parser) on the default model: a thinking budget of 0 forces the end of the
    analysis, and a constraint (which applies after it) writes a preamble and a call, so that
    what the parsers find does not depend on what the tiny model would write."""
    answer = (
        "Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
    )
    forced = {"regex": re.escape(answer)}
    body = {
        "tools": [TOOLS_WEATHER],
        "max_tokens": 80,
        "extra_body": {"structured_outputs": forced, "thinking_token_budget": 0},
    }
    args = [*SERVER_ARGS, "--chat-template", GPT_OSS_STYLE, "--reasoning-parser", "openai_gptoss"]
    with RemoteServer(args) as remote:
        client = remote.openai_client()
        full, chunks = run_together(
            lambda: chat(client, **body), lambda: list(chat(client, stream=True, **body))
        )
        log = remote.output()
    assert 'tool_choice "auto": the openai tool-call parser' in log
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert getattr(choice.message, "reasoning_content", None) is None
    [call] = choice.message.tool_calls
    weather = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert (call.function.name, call.function.arguments) == weather
    assert assemble(chunks) == ("Checking.", [weather], "tool_calls")
    # the reasoning tokens are the forced end of the analysis, no more
    forced_end = GptOssReasoningParser(Tokenizer(hf_gguf_tokenizer)).end_token_ids()
    assert full.usage.completion_tokens_details.reasoning_tokens == len(forced_end)
