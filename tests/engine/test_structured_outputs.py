"""Structured outputs in the engine, on the default model: every constrained output satisfies
its constraint, the unconstrained requests of a mixed batch get exactly their tokens alone, and
a constraint that does not compile is refused before anything runs."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jsonschema
import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.engine.errors import InvalidRequestError
from pyxllm.sampling_params import JSON_WHITESPACE_LIMIT, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a user of our website as JSON."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory=0.25)


def constrained(llm, prompt, spec: StructuredOutputsParams, **params):
    params = SamplingParams(
        **{"temperature": 0, "max_tokens": 200, **params}, structured_outputs=spec
    )
    run = llm.chat if isinstance(prompt, list) else llm.generate
    return run(prompt, params)[0].outputs


def test_json_schema_output_validates(llm):
    (out,) = constrained(llm, ASK, StructuredOutputsParams(json=PERSON))
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)
    gaps = re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text))
    assert all(len(g) <= JSON_WHITESPACE_LIMIT for g in gaps), out.text


def test_sampled_json_validates_for_every_seed(llm):
    spec = StructuredOutputsParams(json=json.dumps(PERSON))
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=spec)
        for seed in range(3)
    ]
    outs = llm.chat([ASK] * 3, params)  # one batch
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_regex_choice_and_json_object(llm):
    (phone,) = constrained(
        llm,
        "Call me at ",
        StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
        temperature=1.0,
        seed=3,
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text), phone.text
    (answer,) = constrained(
        llm,
        [{"role": "user", "content": "Is water wet?"}],
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    )
    assert answer.text in ("yes", "no", "maybe")
    (obj,) = constrained(llm, ASK, StructuredOutputsParams(json_object=True), max_tokens=100)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # max_tokens cut it: still the start of an object
        assert obj.finish_reason == "length" and obj.text.lstrip().startswith("{")


def test_a_lark_grammar(llm):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
    (out,) = constrained(llm, "Q: 2+3? ", StructuredOutputsParams(grammar=grammar))
    assert re.fullmatch(r"The answer is [0-9]+\.", out.text), out.text


def test_n_samples_each_keep_the_constraint(llm):
    outs = constrained(
        llm,
        "Pick: ",
        StructuredOutputsParams(regex="(red|green|blue)!"),
        n=4,
        temperature=1.0,
        seed=5,
    )
    assert len(outs) == 4 and all(re.fullmatch("(red|green|blue)!", o.text) for o in outs)


def test_logprobs_are_of_the_masked_distribution(llm):
    (out,) = constrained(llm, "Pick: ", StructuredOutputsParams(choice=["yes", "no"]), logprobs=8)
    first = out.logprobs[0]
    allowed = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    texts = llm.get_tokenizer().decode_each(allowed)
    assert out.token_ids[0] in allowed
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    probability = sum(math.exp(first[t].logprob) for t in allowed)
    assert probability == pytest.approx(1.0, abs=1e-4)  # the allowed tokens hold all of it


def test_min_tokens_never_leaves_a_constrained_row_without_tokens(llm):
    (out,) = constrained(
        llm, "Pick: ", StructuredOutputsParams(choice=["yes", "no"]), min_tokens=5, max_tokens=8
    )
    assert out.text.startswith(("yes", "no")) and len(out.token_ids) >= 1


def test_free_requests_in_a_mixed_batch_get_their_tokens_alone(llm):
    prompts = [f"Story {i}: once upon a time" for i in range(16)]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, free)[0].outputs[0].token_ids for p in prompts[::2]]
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex="[a-z ]{5,20}")]
    params = [
        free
        if i % 2 == 0
        else SamplingParams(temperature=0, max_tokens=40, structured_outputs=specs[i // 2 % 2])
        for i in range(16)
    ]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone
    assert re.fullmatch("[a-z ]{5,20}", outs[3].outputs[0].text)


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(regex="(a"), "structured_outputs.regex"),
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "nope"}}}),
            "structured_outputs.json",
        ),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (  # llguidance's parser limit, met at the first token: refused before
            StructuredOutputsParams(choice=[f"x{i}" for i in range(2000)]),
            "structured_outputs.choice",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_anything_runs(llm, spec, field):
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        llm.generate(["fine", "bad"], [good, SamplingParams(max_tokens=2, structured_outputs=spec)])
    assert info.value.param == field
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.num_used_blocks == 0


def test_a_repeated_constraint_compiles_once(llm):
    manager = llm.llm_engine.structured_outputs
    first = manager.submit(StructuredOutputsParams(json=PERSON))
    again = manager.submit(StructuredOutputsParams(json=json.dumps(PERSON, indent=1)))
    assert again.future is first.future


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()


@pytest.fixture(scope="module")
def xgrammar_llm():
    pytest.importorskip("xgrammar", reason="make installs xgrammar (--no-deps)")
    return LLM(
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=0.1,
        structured_outputs_backend="xgrammar",
    )


def test_the_xgrammar_backend_keeps_every_kind_of_constraint(xgrammar_llm):
    (person,) = constrained(xgrammar_llm, ASK, StructuredOutputsParams(json=PERSON))
    jsonschema.validate(json.loads(person.text), PERSON)
    (phone,) = constrained(
        xgrammar_llm,
        "Call ",
        StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
        temperature=1.0,
        seed=2,
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text)
    (pick,) = constrained(xgrammar_llm, "Pick: ", StructuredOutputsParams(choice=["yes", "no"]))
    assert pick.text in ("yes", "no")
    assert_eos_only_after_a_complete_constraint(xgrammar_llm)
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    (answer,) = constrained(xgrammar_llm, "Q: 2+3? ", StructuredOutputsParams(grammar=ebnf))
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.text)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        xgrammar_llm.generate(
            "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a"))
        )


def test_preempted_and_recomputed_requests_keep_their_constraint(llm):
    """A KV cache too small for the batch preempts requests mid-way; recomputed, their matchers
    go on where they were, so the outputs equal those of an unhurried engine."""
    prompts = [f"Describe user number {i} as JSON." for i in range(4)]
    params = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    calm = [o.outputs[0].text for o in llm.generate(prompts, params)]
    tight = LLM(dtype="float32", max_model_len=128, kv_cache_memory=0.006, max_seqs_per_batch=4)
    outs = tight.generate(prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == calm
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def assert_eos_only_after_a_complete_constraint(llm):
    """With ``ignore_eos`` the output runs on past the constraint's end: only EOS follows (and
    the engine lives on; xgrammar raises when asked for the mask of a terminated matcher)."""
    (out,) = constrained(
        llm, "Pick: ", StructuredOutputsParams(choice=["yes", "no"]), ignore_eos=True, max_tokens=6
    )
    assert out.text in ("yes", "no") and len(out.token_ids) == 6
    assert set(out.token_ids[-3:]) <= llm.get_tokenizer().eos_token_ids


def test_only_eos_follows_a_complete_constraint(llm):
    assert_eos_only_after_a_complete_constraint(llm)


# --- a constraint that fails while generating ---------------------------------------------------


class _Sabotaged:
    """A matcher that fails one way: the grammar library raises for its mask (``"mask"``; the
    batched fill fails too), or its next token is refused (``"token"``)."""

    def __init__(self, matcher, how: str) -> None:
        self._matcher, self._how = matcher, how
        if how == "mask":
            self.matcher = "not a matcher"  # what the batched fill reads

    def __getattr__(self, name):
        return getattr(self._matcher, name)

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self._how == "mask":
            raise RuntimeError("grammar library broke")
        self._matcher.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._how != "token" and self._matcher.accept_token(token_id)


def failures_counted(engine) -> float:
    """``pyxllm:request_failures_total{cause="constraint"}`` of ``engine``."""
    from prometheus_client import generate_latest

    text = generate_latest(engine.metrics.registry).decode()
    (line,) = [
        ln
        for ln in text.splitlines()
        if ln.startswith("pyxllm:request_failures_total") and 'cause="constraint"' in ln
    ]
    return float(line.split()[-1])


@pytest.mark.parametrize(
    "how, cause",
    [
        ("mask", "the grammar library could not compute the allowed tokens (RuntimeError)"),
        ("token", "broke the request's constraint"),
    ],
)
def test_a_failing_constraint_fails_its_request_alone(llm, how, cause):
    """A grammar library that raises for a request's mask, or a sampled token its constraint
    refuses, fails that request with ConstraintFailedError naming the cause (not a ``stop``
    with output that may break the constraint), counted in the failures metric; a free and
    another constrained request in the same batch get their tokens alone, and every KV block
    is freed."""
    from pyxllm.engine.errors import ConstraintFailedError

    engine = llm.llm_engine
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    choice = StructuredOutputsParams(regex="[a-z ]{5,20}")
    fine = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice)
    bad = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice)
    work = {"free": ("The sky is", free), "fine": ("Pick a word: ", fine)}
    alone = {
        rid: llm.generate(p, params)[0].outputs[0].token_ids for rid, (p, params) in work.items()
    }
    counted = failures_counted(engine)
    for request_id, (prompt, params) in {**work, "bad": ("Say hi: ", bad)}.items():
        engine.add_request(engine.input_processor.process(request_id, prompt, params))
    engine.requests["bad"].matcher = _Sabotaged(engine.requests["bad"].matcher, how)
    finished, failures = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        failures.update(engine.pop_failures())
    assert list(failures) == ["bad"] and isinstance(failures["bad"], ConstraintFailedError)
    assert str(failures["bad"]).startswith("structured output failed: ")
    assert cause in str(failures["bad"])
    assert finished == alone
    assert engine.kv_cache_manager.num_used_blocks == 0
    assert failures_counted(engine) == counted + 1


def test_a_grammar_past_the_library_limits_fails_with_its_reason(llm):
    """A Lark grammar of 2,500 alternatives compiles, then llguidance refuses the first token
    (its parser holds 2,000 items a row): the request fails naming the library's reason, and
    2,000 repeats of one choice are one choice."""
    from pyxllm.engine.errors import RequestFailedError

    grammar = "start: " + " | ".join(f'"x{i}"' for i in range(2500))
    with pytest.raises(RequestFailedError, match="Current row has 2501 items; max is 2000"):
        constrained(llm, "Say: ", StructuredOutputsParams(grammar=grammar), max_tokens=4)
    assert llm.llm_engine.kv_cache_manager.num_used_blocks == 0
    (out,) = constrained(llm, "Say: ", StructuredOutputsParams(choice=["a"] * 2000))
    assert out.text == "a"


def test_a_failing_constraint_is_a_500_naming_the_cause():
    """Over HTTP the failed request is a 500 whose message names the cause and the request id
    (a streamed one: an error event after the first chunks), and the server serves on."""
    from fastapi.testclient import TestClient

    from pyxllm.engine.async_engine import AsyncEngine
    from pyxllm.entrypoints.openai.api_server import build_app
    from pyxllm.entrypoints.openai.server_options import ServerOptions

    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=0.05)
    manager = llm.llm_engine.structured_outputs
    backend = manager._get_backend().result()
    real_new_matcher = backend.new_matcher
    backend.new_matcher = lambda compiled: _Sabotaged(real_new_matcher(compiled), "token")
    engine = AsyncEngine(llm.llm_engine)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say a word."}],
        "max_tokens": 10,
        "structured_outputs": {"regex": "[a-z]{3,8}"},
    }
    try:
        with TestClient(build_app(engine, ServerOptions())) as client:
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert error["message"].startswith("structured output failed: the sampled token")
            assert re.search(r"\(request id chatcmpl-\w+\)$", error["message"]), error
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200
            last = json.loads(events[-2][len("data: ") :])  # then data: [DONE]
            assert last["error"]["message"].startswith("structured output failed:"), events
            free = {**body, "structured_outputs": None}
            assert client.post("/v1/chat/completions", json=free).status_code == 200
            metrics = client.get("/metrics").text
            assert 'pyxllm:request_failures_total{cause="constraint"' in metrics.replace(
                'model_name="SmolLM2-135M-Instruct",', ""
            )
    finally:
        engine.shutdown()


def test_a_request_waits_in_the_engine_while_its_grammar_compiles(llm, monkeypatch):
    """``add_request`` never waits for a grammar (vLLM's WAITING_FOR_FSM): the request waits in
    the engine, which steps the others meanwhile and admits it once its grammar has compiled;
    an abort reaches it there, and one that compiles too late fails naming its field."""
    from concurrent.futures import Future

    from pyxllm.engine.structured_output import GrammarHandle

    engine, manager = llm.llm_engine, llm.llm_engine.structured_outputs
    spec = StructuredOutputsParams(choice=["yes", "no"])
    compiled = manager.submit(spec)
    pending: list[Future] = []

    def submit(spec):  # a compile that finishes when the test says
        pending.append(Future())
        return GrammarHandle(spec, pending[-1], compiled.backend)

    monkeypatch.setattr(manager, "submit", submit)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)
    free = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    process = engine.input_processor.process
    engine.add_request(process("waits", "Answer: ", params))
    engine.add_request(process("free", "Hello", free))
    assert set(engine.waiting_for_grammar) == {"waits"} and engine.stats()["num_waiting"] == 2
    finished = {}
    while "free" not in finished:
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert "waits" in engine.waiting_for_grammar and engine.has_unfinished_requests()
    pending[0].set_result(compiled.compiled())
    while "waits" not in finished:
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert finished["waits"].outputs[0].text in ("yes", "no")
    assert not engine.waiting_for_grammar and not engine.pop_failures()
    engine.add_request(process("aborted", "Answer: ", params))
    engine.abort_request("aborted")
    assert not engine.waiting_for_grammar and not engine.has_unfinished_requests()
    late = process("late", "Answer: ", params)
    engine.add_request(dataclasses.replace(late, arrival_time=late.arrival_time - 60))
    assert engine.step() == [] and not engine.waiting_for_grammar
    (error,) = engine.pop_failures().values()
    assert isinstance(error, InvalidRequestError) and "took longer than" in str(error)
