"""The thinking budget without a model: its counting and forcing rule, the one-token mask,
the request fields that set it (chat's ``thinking_token_budget``, ``--reasoning-budget``,
Responses' ``reasoning.effort``, Anthropic's ``thinking``) and their 400s. Through a server,
on a tiny random Qwen3: tests/entrypoints/openai/chat/test_reasoning.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pyxllm.cli.main import parse_args
from pyxllm.engine.errors import InvalidRequestError
from pyxllm.engine.input_processor import InputProcessor, TokensPrompt
from pyxllm.engine.request import Request
from pyxllm.engine.thinking_budget import ThinkingBudget, forced_token_bitmask
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.entrypoints.anthropic.messages_input import chat_request as anthropic_chat_request
from pyxllm.entrypoints.anthropic.messages_input import check_supported as anthropic_check
from pyxllm.entrypoints.anthropic.protocol import MessagesRequest
from pyxllm.entrypoints.llm import LLM
from pyxllm.entrypoints.openai.chat.reasoning import get_reasoning_parser
from pyxllm.entrypoints.openai.chat.serving import OpenAIServingChat
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import ChatCompletionRequest
from pyxllm.entrypoints.openai.responses.input_items import (
    REASONING_EFFORT_BUDGETS,
    chat_request,
    check_supported,
)
from pyxllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.executor.logits_processors import unpack_bitmask
from pyxllm.sampling_params import SamplingParams
from tests.model_fixtures import thinking_tokenizer

START, END = (7,), (8, 9)  # a one-token <think> and a two-token </think>


def run(budget: ThinkingBudget, model: list[int], steps: int) -> list[int]:
    """The output of a "model" that writes ``model``'s tokens in order, under ``budget``."""
    output: list[int] = []
    tokens = iter(model)
    for _ in range(steps):
        forced = budget.forced_token(output)
        output.append(next(tokens) if forced is None else forced)
        budget.observe(output[-len(budget.end_ids) :])
    return output


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_forcing_closes_after_budget_reasoning_tokens(budget):
    """The model's tokens (never the end tag) up to the budget, then the whole end tag, one
    token a step; a leading start tag is not counted as reasoning."""
    model = [1, 2, 3, 4, 5, 6, 10, 11, 12]
    out = run(ThinkingBudget(budget, START, END), model, 7)
    assert out[: budget + 2] == [*model[:budget], *END]
    assert out[budget + 2 :] == model[budget:5]
    with_start = run(ThinkingBudget(budget, START, END), [7, *model], 7)
    if budget:  # 0 closes at once, before the model could open
        assert with_start[: budget + 3] == [7, *model[:budget], *END]


def test_a_started_end_tag_is_continued_not_restarted():
    """The model wrote the end tag's first token as its last allowed one: forcing goes on with
    the second, so the tag appears once; a lone first token mid-way is reasoning."""
    b = ThinkingBudget(2, (), END)
    assert run(b, [1, 8, 5, 6], 4) == [1, 8, 9, 5] and b.ended
    b = ThinkingBudget(3, (), END)
    assert run(b, [1, 8, 3, 4], 5) == [1, 8, 3, 8, 9]


def test_the_model_closing_itself_ends_the_budget():
    b = ThinkingBudget(5, START, END)
    out = run(b, [1, 8, 9, 4, 5, 6, 7], 7)
    assert out == [1, 8, 9, 4, 5, 6, 7] and b.ended
    assert b.forced_token(out) is None and b.room(out) is None


def test_room_bounds_speculation():
    """What a speculative step may emit: the free tokens left, 0 while forcing."""
    b = ThinkingBudget(3, START, END)
    assert [b.room(o) for o in ([], [7], [7, 1], [7, 1, 2, 3], [1, 2, 3, 8])] == [3, 3, 2, 0, 0]


def test_a_request_tracks_its_budget_past_its_prompt():
    """The engine's request: the prompt's last token is no part of the end tag it watches."""
    params = SamplingParams(
        max_tokens=8, thinking_token_budget=2, think_start_token_ids=START, think_end_token_ids=END
    )
    request = Request("r", None, [1, 8], params, detokenizer=None)
    assert (request.forced_token(), request.thinking_room()) == (None, 2)
    for token in (7, 9, 4):  # <think>, then 9 (not closing: the 8 before it is the prompt's)
        request.token_ids.append(token)
        request.accept_token(request.num_tokens - 1)
    assert not request.thinking.ended
    assert (request.forced_token(), request.thinking_room()) == (8, 0)
    for token in END:
        request.token_ids.append(token)
        request.accept_token(request.num_tokens - 1)
    assert request.thinking.ended
    assert (request.forced_token(), request.thinking_room()) == (None, None)


@pytest.mark.parametrize("token", [0, 31, 32, 63, 100])
def test_forced_bitmask_allows_one_token(token):
    row = forced_token_bitmask(token, 101)
    assert row.dtype == torch.int32 and row.shape == (4,)
    allowed = unpack_bitmask(row.unsqueeze(0), 101)[0]
    assert allowed.nonzero().flatten().tolist() == [token]


def test_sampling_params_checks_the_budget():
    assert SamplingParams(thinking_token_budget=0, think_end_token_ids=[5]).think_end_token_ids == (
        5,
    )
    with pytest.raises(ValueError, match="^thinking_token_budget: must be >= 0"):
        SamplingParams(thinking_token_budget=-1, think_end_token_ids=(5,))


def test_a_budget_without_tags_is_refused_unless_the_llm_has_a_reasoning_parser(think_tok):
    """``SamplingParams(thinking_token_budget=N)`` alone is taken; the engine refuses it with no
    end tag, and ``LLM(reasoning_parser=...)`` fills the parser's tags (not over the request's
    own)."""
    tokenizer = Tokenizer(think_tok)
    processor = InputProcessor(
        tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=64, max_kv_blocks=4, block_size=16
    )
    params = SamplingParams(thinking_token_budget=4)
    with pytest.raises(InvalidRequestError, match="^thinking_token_budget: needs think_end") as e:
        processor.process("r", TokensPrompt([1, 2]), params)
    assert e.value.param == "thinking_token_budget"
    llm = object.__new__(LLM)  # what _with_think_tags reads of an LLM, without a model
    llm._reasoning = get_reasoning_parser("qwen3")(tokenizer)
    start, end = (think_tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    filled = llm._with_think_tags(params)
    assert (filled.think_start_token_ids, filled.think_end_token_ids) == ((start,), (end,))
    assert filled.thinking_token_budget == 4 and filled.unset_fields == params.unset_fields
    processor.process("r", TokensPrompt([1, 2]), filled)
    own = SamplingParams(thinking_token_budget=4, think_end_token_ids=END)
    assert llm._with_think_tags(own) is own
    assert llm._with_think_tags(SamplingParams()).thinking_token_budget is None
    llm._reasoning = None
    assert llm._with_think_tags(params) is params


def test_reasoning_budget_flag():
    args, _ = parse_args(["serve", "--reasoning-parser", "qwen3", "--reasoning-budget", "64"])
    assert args.reasoning_budget == 64
    assert parse_args(["serve"])[0].reasoning_budget == -1
    for argv in (
        ["--reasoning-budget", "64"],
        ["--reasoning-parser", "qwen3", "--reasoning_budget", "-2"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse_args(["serve", *argv])
        assert exc.value.code == 2


def chat_handler(hf_tokenizer, **options) -> OpenAIServingChat:
    """A chat handler on what it reads of an engine, without a model."""
    tokenizer = Tokenizer(hf_tokenizer)
    processor = InputProcessor(
        tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=64, max_kv_blocks=4, block_size=16
    )
    engine = SimpleNamespace(
        model_name="m",
        served_model_names=("m",),
        max_model_len=64,
        max_num_seqs=4,
        task="generate",
        tokenizer=tokenizer,
        input_processor=processor,
    )
    return OpenAIServingChat(engine, ServerOptions(**options))


@pytest.fixture(scope="module")
def think_tok(hf_gguf_tokenizer):
    return thinking_tokenizer(hf_gguf_tokenizer)


def reasoning_fields(chat, **request):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **request)
    ids = list(chat.processor.tokenize(chat.chat_prompt(body)).token_ids)
    return chat.request_reasoning(body, ids)[1]


def test_the_budget_and_its_tags_come_from_the_request_or_the_server(think_tok):
    start, end = (think_tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    chat = chat_handler(think_tok, reasoning_parser="qwen3", reasoning_budget=64)
    fields = reasoning_fields(chat)
    assert fields["thinking_token_budget"] == 64
    assert (fields["think_start_token_ids"], fields["think_end_token_ids"]) == ((start,), (end,))
    assert reasoning_fields(chat, thinking_token_budget=0)["thinking_token_budget"] == 0
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert reasoning_fields(chat, thinking_token_budget=3, **off) == {}  # nothing to cut
    assert "thinking_token_budget" not in reasoning_fields(
        chat_handler(think_tok, reasoning_parser="qwen3")
    )
    for options, budget in (({}, 3), ({"reasoning_parser": "qwen3"}, -1)):
        with pytest.raises(OpenAIError) as exc:
            reasoning_fields(chat_handler(think_tok, **options), thinking_token_budget=budget)
        assert (exc.value.status_code, exc.value.param) == (400, "thinking_token_budget")


def test_responses_effort_and_anthropic_thinking_map_to_the_budget():
    for effort, budget in REASONING_EFFORT_BUDGETS.items():
        request = ResponsesRequest(input="hi", reasoning={"effort": effort})
        check_supported(request)
        assert chat_request(request, []).thinking_token_budget == budget
    assert chat_request(ResponsesRequest(input="hi"), []).thinking_token_budget is None
    for reasoning in ({"effort": "minimal"}, {"summary": "auto"}):
        with pytest.raises(OpenAIError) as exc:
            check_supported(ResponsesRequest(input="hi", reasoning=reasoning))
        assert exc.value.param == "reasoning"
    hi = [{"role": "user", "content": "hi"}]
    thinking = {"type": "enabled", "budget_tokens": 16}
    request = MessagesRequest(model="m", max_tokens=32, messages=hi, thinking=thinking)
    anthropic_check(request)
    assert anthropic_chat_request(request).thinking_token_budget == 16
    disabled = MessagesRequest(model="m", max_tokens=32, messages=hi, thinking={"type": "disabled"})
    assert anthropic_chat_request(disabled).thinking_token_budget is None
    for bad in (
        {"type": "enabled"},
        {"type": "enabled", "budget_tokens": -1},
        {"type": "adaptive"},
    ):
        with pytest.raises(OpenAIError) as exc:
            anthropic_check(MessagesRequest(model="m", max_tokens=32, messages=hi, thinking=bad))
        assert exc.value.param == "thinking"
