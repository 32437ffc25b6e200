"""Beam search: ``LLM.beam_search`` gives transformers' ``generate(num_beams=W)`` beams and scores,
and the server's ``use_beam_search`` gives ``LLM.beam_search``'s.

A tiny random Llama (float32, saved by transformers) runs through both; for each prompt the
``W`` returned sequences must be the same tokens in the same order and their scores
(``sequences_scores``) must agree to 1e-4: without EOS (``ignore_eos``), with the model's EOS
ids, and with an EOS id chosen among the tokens the beams pick, so that sequences finish early,
under several length penalties. The rules themselves (:class:`BeamSearch`) are also checked
on hand-made logprobs. Over HTTP (the ``openai`` client against a server subprocess on the
same checkpoint), completions and chat completions, streamed or not, answer the same beams as
choices, and the fields beam search cannot honour are refused by name.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import openai
import pytest
import torch
from transformers import GenerationConfig

from pyxllm import LLM, BeamSearchParams
from pyxllm.engine.beam_search import BeamSearch, run_beam_search
from pyxllm.engine.input_processor import ChatPrompt
from pyxllm.outputs import Logprob
from tests.model_fixtures import build_checkpoint
from tests.utils import RemoteServer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was"]
NEW_TOKENS = 8
LLM_KWARGS = dict(dtype="float32", max_model_len=96, kv_cache_memory=0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_gguf_tokenizer):
    """(checkpoint dir, transformers model, prompts as token ids)."""
    directory, model = build_checkpoint(
        "llama", tmp_path_factory.mktemp("beam") / "llama", hf_gguf_tokenizer, seed=3
    )
    prompts = [hf_gguf_tokenizer(p).input_ids for p in PROMPTS]
    return directory, model, prompts


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint[0]), **LLM_KWARGS)


@pytest.fixture(scope="module")
def eos_checkpoint(checkpoint, tmp_path_factory):
    """A copy of the checkpoint with two more EOS ids (in generation_config.json): the fifth
    token of the first prompt's best beam and the third of its second, so that beams end with
    EOS during the search."""
    directory, model, prompts = checkpoint
    free = hf_beam_search(model, prompts[0], 4, NEW_TOKENS, eos=None)
    chosen = [free[0][0][4], free[1][0][2]]
    copy = tmp_path_factory.mktemp("beam_eos") / "llama"
    shutil.copytree(directory, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": chosen}))
    return copy


@pytest.fixture(scope="module")
def eos_llm(eos_checkpoint):
    return LLM(model=str(eos_checkpoint), **LLM_KWARGS)


def hf_beam_search(model, ids, width, new_tokens, eos, length_penalty=1.0):
    """transformers' beams for one prompt: ``[(generated ids up to and with the EOS, score)]``,
    best first."""
    config = GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        length_penalty=length_penalty,
    )
    inputs = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for row, score in zip(out.sequences, out.sequences_scores):
        generated = row[len(ids) :].tolist()
        ends = [i for i, t in enumerate(generated) if t in (eos or ())]
        beams.append((generated[: ends[0] + 1] if ends else generated, float(score)))
    return beams


def check_equal(llm, model, prompts, width, length_penalty=1.0, ignore_eos=False):
    """``LLM.beam_search`` against transformers on every prompt; returns pyxllm's outputs."""
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=NEW_TOKENS,
        ignore_eos=ignore_eos,
        length_penalty=length_penalty,
    )
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], params)
    eos = None if ignore_eos else sorted(llm.get_tokenizer().eos_token_ids)
    for ids, output in zip(prompts, outputs):
        want = hf_beam_search(model, ids, width, NEW_TOKENS, eos, length_penalty)
        got = [(s.tokens[len(ids) :], s.score) for s in output.sequences]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, got_score), (_, want_score) in zip(got, want):
            assert got_score == pytest.approx(want_score, abs=1e-4)
        for seq in output.sequences:
            assert seq.tokens[: len(ids)] == ids
            generated = len(seq.tokens) - len(ids)
            assert seq.score == pytest.approx(seq.cum_logprob / generated**length_penalty)
    return outputs


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_without_eos(llm, checkpoint, width):
    _, model, prompts = checkpoint
    outputs = check_equal(llm, model, prompts, width, ignore_eos=True)
    assert all(len(o.sequences) == width for o in outputs)
    assert {s.finish_reason for o in outputs for s in o.sequences} == {"length"}


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_with_the_models_eos(llm, checkpoint, width):
    _, model, prompts = checkpoint
    check_equal(llm, model, prompts, width)


@pytest.mark.parametrize(
    ("width", "length_penalty"), [(2, 1.0), (4, 1.0), (4, 0.5), (3, -0.5), (4, 2.0)]
)
def test_beams_equal_transformers_when_beams_end_with_eos(
    eos_llm, checkpoint, width, length_penalty
):
    _, model, prompts = checkpoint
    outputs = check_equal(eos_llm, model, prompts, width, length_penalty)
    stopped = [s for o in outputs for s in o.sequences if s.finish_reason == "stop"]
    if length_penalty <= 1:  # a penalty of 2 favours the long beams: the short ones lose
        assert stopped, "no beam ended with the EOS token"
    eos = eos_llm.get_tokenizer().eos_token_ids
    assert all(s.tokens[-1] in eos and s.stop_reason == s.tokens[-1] for s in stopped)


def test_text_is_the_decoded_sequence(llm, checkpoint):
    _, _, prompts = checkpoint
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    (output,) = llm.beam_search(PROMPTS[0], params)
    tokenizer = llm.get_tokenizer()
    assert [s.text for s in output.sequences] == [
        tokenizer.decode(s.tokens) for s in output.sequences
    ]
    assert output.sequences[0].text.startswith(PROMPTS[0])
    assert output.sequences[0].tokens[: len(prompts[0])] == prompts[0]


def test_beams_share_the_prompts_cached_blocks(llm):
    """Every beam of every step after the first finds the prompt's full blocks in the prefix
    cache (counted in tokens)."""
    prompt = " ".join(str(i) for i in range(15))
    full_blocks = len(llm.get_tokenizer().encode(prompt)) // 16
    assert full_blocks >= 2
    before = llm.llm_engine.stats()["prefix_cache_hits"]
    llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    hits = llm.llm_engine.stats()["prefix_cache_hits"] - before
    assert hits >= 2 * 2 * full_blocks * 16  # steps 2 and 3, two beams each


def test_bad_parameters_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="^beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="^temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="^max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=200))


# --- the rules on hand-made logprobs ----------------------------------------------------------

EOS = 0


def step(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {token: Logprob(logprob) for token, logprob in pairs}


def test_an_eos_candidate_ranked_past_the_beam_width_does_not_finish():
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=3), [EOS])
    # K = 2 candidates; EOS is second: past width 1, so it is dropped, not finished
    search.advance([step((5, -0.1), (EOS, -0.2), (6, -3.0), (8, -4.0))])
    assert search.finished == [] and search.pending() == [[7, 5]]
    search.advance([step((EOS, -0.3), (9, -0.4), (6, -3.0), (8, -4.0))])
    assert [s.tokens for s in search.finished] == [[7, 5, EOS]]
    assert search.finished[0].score == pytest.approx(-0.4 / 2)


def test_the_search_stops_once_no_live_beam_can_beat_the_finished_ones():
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=10), [EOS])
    search.advance([step((EOS, -0.1), (5, -2.0), (6, -3.0), (8, -4.0))])
    assert search.done and search.pending() == []
    assert search.result(str).sequences[0].finish_reason == "stop"


@pytest.mark.parametrize(("length_penalty", "stops"), [(1.0, True), (2.0, False)])
def test_a_length_penalty_keeps_longer_beams_in_the_race(length_penalty, stops):
    params = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=length_penalty)
    search = BeamSearch([7], params, [EOS])
    search.advance([step((5, -0.5), (EOS, -1.0), (6, -3.0), (8, -4.0))])
    assert [s.tokens for s in search.finished] == [[7, EOS]] and not search.done
    assert search.pending() == [[7, 5], [7, 6]]
    search.advance(
        [step((EOS, -0.1), (9, -2.0), (1, -5.0), (2, -6.0)), step((EOS, -0.1), (10, -0.2))]
    )
    # the best live beam, [7, 5, 9] at -2.5, is scored at its current length (2) against
    # the worst finished score, -1.0: -1.25 cannot beat it, -0.625 can
    assert search.done is stops
    assert [s.tokens for s in search.finished] == [[7, 5, EOS], [7, EOS]]
    assert search.finished[0].score == pytest.approx(-0.6 / 2**length_penalty)


def test_cancelling_a_search_aborts_the_requests_of_its_step():
    """A client that goes away cancels the server's search: its step's requests are aborted
    (their KV blocks freed), not left to run."""
    aborted = []

    async def generate(request):
        await asyncio.Event().wait()  # a step that never ends
        yield

    engine = SimpleNamespace(
        input_processor=SimpleNamespace(process=lambda rid, _, __: SimpleNamespace(request_id=rid)),
        generate=generate,
        abort=aborted.append,
    )
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=4), [EOS])

    async def cancel_mid_step():
        task = asyncio.ensure_future(
            run_beam_search(engine, SimpleNamespace(request_id="cmpl-1"), search)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_step())
    assert aborted == ["cmpl-1-beam0-0"]


# --- over HTTP ---------------------------------------------------------------------------------

MODEL = "tiny-beams"
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def client(eos_checkpoint):
    args = [str(eos_checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    args += ["--max-model-len", "96", "--kv-cache-memory", "0.05"]
    with RemoteServer(args, env={"OMP_NUM_THREADS": "1"}) as server:
        yield server.openai_client()


def expected_choices(llm, prompt_ids, width, max_tokens, length_penalty=1.0):
    """``LLM.beam_search``'s sequences as the server's choices: ``(text, finish_reason)``."""
    params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty)
    (output,) = llm.beam_search({"prompt_token_ids": prompt_ids}, params)
    tokenizer = llm.get_tokenizer()
    choices = []
    for seq in output.sequences:
        generated = seq.tokens[len(prompt_ids) :]
        shown = generated[:-1] if seq.finish_reason == "stop" else generated
        choices.append((tokenizer.decode(shown), seq.finish_reason))
    return choices, sum(len(seq.tokens) - len(prompt_ids) for seq in output.sequences)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_answer_the_beams_as_choices(client, eos_llm, checkpoint, stream):
    ids = checkpoint[2][0]
    want, generated = expected_choices(eos_llm, ids, 4, NEW_TOKENS)
    assert {reason for _, reason in want} == {"stop", "length"}  # both kinds are checked
    body = dict(model=MODEL, prompt=ids, n=4, max_tokens=NEW_TOKENS, extra_body=BEAM)
    if not stream:
        response = client.completions.create(**body)
        got = [(c.text, c.finish_reason) for c in sorted(response.choices, key=lambda c: c.index)]
        assert got == want
        assert response.usage.completion_tokens == generated
        return
    chunks = list(client.completions.create(**body, stream=True))
    choices = [c for chunk in chunks for c in chunk.choices]
    assert sorted(c.index for c in choices) == [0, 1, 2, 3]  # each choice whole, in one chunk
    assert [(c.text, c.finish_reason) for c in sorted(choices, key=lambda c: c.index)] == want


def test_chat_completions_answer_the_beams_as_choices(client, eos_llm, checkpoint):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = eos_llm.llm_engine.input_processor.tokenize(ChatPrompt(messages))
    want, _ = expected_choices(eos_llm, list(prompt.token_ids), 3, NEW_TOKENS, 0.5)
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=3,
        max_completion_tokens=NEW_TOKENS,
        extra_body={**BEAM, "length_penalty": 0.5},
    )
    got = [(c.message.content, c.finish_reason) for c in response.choices]
    assert got == want


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("temperature", {"temperature": 0.7}),
        ("top_p", {"top_p": 0.5}),
        ("stop", {"stop": ["x"]}),
        ("logprobs", {"logprobs": True}),
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("n", {"n": 11}),
    ],
)
def test_fields_beam_search_cannot_honour_are_refused_by_name(client, field, body):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={**BEAM, **body},
        )
    assert info.value.body["param"] == field, info.value.body


def test_length_penalty_needs_beam_search(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"length_penalty": 2.0}
        )
    assert info.value.body["param"] == "length_penalty"
