"""Structured outputs in the engine, on the default model: every constrained output satisfies
its constraint, the unconstrained requests of a mixed batch get exactly their tokens alone, and
a constraint that does not compile is refused before anything runs."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from pyxllm import LLM, SamplingParams
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
