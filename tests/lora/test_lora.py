"""LoRA adapters (``enable_lora``): PEFT adapters around a tiny random Llama, each served greedy
equal to transformers with that adapter merged (``merge_and_unload``) in float32, alone and in
one batch with the other adapters and the base model; adapters that cannot be served are refused
naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from pyxllm import LLM, LoRARequest, SamplingParams
from pyxllm.lora.adapter import LoRAAdapterError
from tests.model_fixtures import build_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
# two prompts of more than a 16-token block (prefix-cache hits), one shorter
PROMPTS = [list(range(5, 40, 2)), [7, 7, 1200, 3, 88, 19, 4], list(range(1000, 1060, 3))]
KWARGS = dict(max_model_len=96, kv_cache_memory=0.05, dtype="float32")
# each adapter: its PEFT config (targets, rank, alpha, rsLoRA)
ADAPTERS = {
    "attn": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], r=8, lora_alpha=16),
    "mlp": dict(
        target_modules=["gate_proj", "up_proj", "down_proj"], r=4, lora_alpha=8, use_rslora=True
    ),
    "all": dict(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], r=16, lora_alpha=8),
}


def _adapter(base_model, config: dict, seed: int):
    """A PEFT model around a copy of ``base_model`` with random A and B (PEFT starts B at zero,
    which would leave the base model's output unchanged)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(**config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    return peft_model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory, hf_gguf_tokenizer):
    """``(base dir, {name: (adapter dir, merged transformers model)})``."""
    root = tmp_path_factory.mktemp("lora")
    base_dir, base = build_checkpoint("llama", root / "base", hf_gguf_tokenizer, seed=3)
    adapters = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        peft_model = _adapter(base, config, seed=10 + i)
        peft_model.save_pretrained(root / name)
        adapters[name] = (root / name, peft_model.merge_and_unload().eval())
    return base_dir, base, adapters


@pytest.fixture(scope="module")
def llm(models):
    base_dir, _, _ = models
    return LLM(model=str(base_dir), enable_lora=True, max_loras=2, **KWARGS)


def _request(models, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(models[2][name][0]))


def _hf_greedy(model, ids: list[int]) -> list[int]:
    config = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config)
    return out[0, len(ids) :].tolist()


def _tokens_and_logprobs(output):
    sample = output.outputs[0]
    return sample.token_ids, [top[t].logprob for t, top in zip(sample.token_ids, sample.logprobs)]


def test_each_adapter_alone_equals_transformers_with_it_merged(models, llm):
    _, base, adapters = models
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for lora_id, name in enumerate(ADAPTERS, start=1):
        outputs = llm.generate(prompts, GREEDY, lora_request=_request(models, name, lora_id))
        merged = adapters[name][1]
        for prompt, output in zip(PROMPTS, outputs):
            assert output.outputs[0].token_ids == _hf_greedy(merged, prompt), name
    base_out = llm.generate(prompts, GREEDY)
    for prompt, output in zip(PROMPTS, base_out):
        assert output.outputs[0].token_ids == _hf_greedy(base, prompt)
    # the adapters change the answers (the test would pass on the base model otherwise)
    with_all = llm.generate(prompts, GREEDY, lora_request=_request(models, "all", 3))
    assert [o.outputs[0].token_ids for o in with_all] != [o.outputs[0].token_ids for o in base_out]


def test_a_mixed_batch_gives_each_request_its_tokens_alone(models, llm):
    """Three adapters and the base model in one batch (``max_loras=2``: the scheduler lets two
    adapters run at once, the third waits): every request gets the tokens and log-probabilities
    it gets alone, bit for bit (float32, batch invariance). The same prompts run on the base
    model first, then on each adapter: a prefix-cache block shared between them would give an
    adapter the base model's keys and values, and its tokens would leave transformers'."""
    _, base, adapters = models
    names = [None, *ADAPTERS]
    requests = [
        (prompt, None if name is None else _request(models, name, i))
        for prompt in PROMPTS
        for i, name in enumerate(names)
    ]
    alone = [
        _tokens_and_logprobs(llm.generate([{"prompt_token_ids": p}], GREEDY, lora_request=r)[0])
        for p, r in requests
    ]
    for (prompt, request), (tokens, _) in zip(requests, alone):
        reference = base if request is None else adapters[request.lora_name][1]
        assert tokens == _hf_greedy(reference, prompt), request
    hits_before = llm.llm_engine.stats()["prefix_cache_hits"]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        GREEDY,
        lora_request=[r for _, r in requests],
    )
    assert [_tokens_and_logprobs(o) for o in mixed] == alone
    # each (prompt, adapter) ran alone before, so the mixed batch hits the cache, only its own
    assert llm.llm_engine.stats()["prefix_cache_hits"] > hits_before
    assert len({tuple(t) for t, _ in alone}) == len(alone)


def _write_adapter(directory, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_adapters_that_cannot_be_served_are_refused_by_name(models, llm, tmp_path):
    good = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"], bias="none")
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    hidden = 64
    fitting = {f"{key}.lora_A.weight": torch.zeros(4, hidden)}
    cases = {
        "missing": (str(tmp_path / "nowhere"), "no directory", True),
        "rank": (
            _write_adapter(tmp_path / "rank", {**good, "r": 128}, fitting),
            "above --max-lora-rank",
            False,
        ),
        "dora": (
            _write_adapter(tmp_path / "dora", {**good, "use_dora": True}, fitting),
            "use_dora",
            False,
        ),
        "saved": (
            _write_adapter(tmp_path / "saved", {**good, "modules_to_save": ["lm_head"]}, fitting),
            "modules_to_save",
            False,
        ),
        "shape": (
            _write_adapter(
                tmp_path / "shape",
                good,
                {
                    f"{key}.lora_A.weight": torch.zeros(4, 32),
                    f"{key}.lora_B.weight": torch.zeros(64, 4),
                },
            ),
            "do not fit the base model",
            False,
        ),
        "module": (
            _write_adapter(
                tmp_path / "module",
                good,
                {
                    "base_model.model.model.layers.0.nope.lora_A.weight": torch.zeros(4, hidden),
                    "base_model.model.model.layers.0.nope.lora_B.weight": torch.zeros(64, 4),
                },
            ),
            "no linear layer",
            False,
        ),
    }
    assert llm.llm_engine.executor.model_config.hidden_size == hidden
    for i, (name, (path, message, not_found)) in enumerate(cases.items(), start=50):
        with pytest.raises(LoRAAdapterError, match=message) as caught:
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest(name, i, path))
        assert caught.value.not_found is not_found
        assert repr(name) in str(caught.value)
    # nothing leaked: the engine still serves
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["hi"], GREEDY)[0].outputs[0].token_ids


def test_the_graph_runner_replays_any_mix_of_adapters_with_the_eager_bits(models, llm):
    """``graph_backend="graph"``: one trace per batch size serves every decode step, whatever
    adapters its rows use (three adapters and the base model, ``max_loras=2``, so the sets of
    adapters change between steps); each request's tokens and log-probabilities are the eager
    runner's bit for bit, and so the merged model's. Steps on the base model alone replay the
    bucket's capture without adapters, with the eager bits too."""
    base_dir, base, adapters = models
    graph = LLM(
        model=str(base_dir),
        enable_lora=True,
        max_loras=2,
        graph_backend="graph",
        max_seqs_per_batch=4,
        **KWARGS,
    )
    runner = graph.llm_engine.executor.driver.runner
    assert runner.name == "graph"
    names = [None, "attn", "mlp", "all"]
    requests = [
        (PROMPTS[i % len(PROMPTS)], None if name is None else _request(models, name, i))
        for i, name in enumerate(names)
    ]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    loras = [r for _, r in requests]
    replayed = graph.generate(prompts, GREEDY, lora_request=loras)
    eager = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [_tokens_and_logprobs(o) for o in replayed] == [_tokens_and_logprobs(o) for o in eager]
    for (prompt, request), output in zip(requests, replayed):
        reference = base if request is None else adapters[request.lora_name][1]
        assert output.outputs[0].token_ids == _hf_greedy(reference, prompt), request
    # the decode steps replayed: three rows on two adapters and the base model, then the third
    # adapter alone
    assert sum(runner.replays.values()) >= NEW_TOKENS
    assert runner.replays[4] and runner.replays[1]
    # steps on the base model alone replay the capture without adapters, with the same bits
    assert not any(runner.plain_replays.values())
    base_prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    plain = graph.generate(base_prompts, GREEDY)
    assert runner.plain_replays[2] >= NEW_TOKENS - 1
    want = llm.generate(base_prompts, GREEDY)
    assert [_tokens_and_logprobs(o) for o in plain] == [_tokens_and_logprobs(o) for o in want]


def test_lora_flags_are_checked():
    with pytest.raises(ValueError, match="--graph-backend: not with --enable-lora"):
        LLM(enable_lora=True, graph_backend="compile")
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        LLM(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="--enable-lora"):
        LLM(**KWARGS).generate(["hi"], GREEDY, lora_request=LoRARequest("a", 1, "/x"))


# --- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote(models):
    from tests.utils import RemoteServer

    base_dir, _, adapters = models
    args = [
        *(str(base_dir), "--enable-lora", "--allow-runtime-lora-updating"),
        *("--lora-modules", f"attn={adapters['attn'][0]}"),
        *("--max-model-len", "96", "--kv-cache-memory", "0.05", "--dtype", "float32"),
    ]
    with RemoteServer(args) as server:
        yield server


def _complete(client, model: str) -> list[str]:
    """The greedy completion of each prompt by ``model``; each answer reports that model."""
    texts = []
    for prompt in PROMPTS:
        answer = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
        )
        assert answer.model == model
        texts.append(answer.choices[0].text)
    return texts


def test_the_server_serves_adapters_by_name_and_loads_them_at_runtime(models, llm, remote):
    import httpx

    client = remote.openai_client()
    cards = {card.id: card for card in client.models.list().data}
    base = next(name for name in cards if name != "attn")
    assert cards["attn"].model_extra["parent"] == base
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, lora_id in (("attn", 1), ("mlp", 2)):
        want = [
            o.outputs[0].text
            for o in llm.generate(prompts, GREEDY, lora_request=_request(models, name, lora_id))
        ]
        if name == "mlp":  # not served yet: a 404, then loaded at runtime
            with pytest.raises(Exception, match="does not exist"):
                _complete(client, "mlp")
            answer = httpx.post(
                remote.url_for("v1", "load_lora_adapter"),
                json={"lora_name": "mlp", "lora_path": str(models[2]["mlp"][0])},
            )
            assert answer.status_code == 200, answer.text
        assert _complete(client, name) == want, name
    assert _complete(client, base) == [o.outputs[0].text for o in llm.generate(prompts, GREEDY)]
    # a bad adapter is refused naming the field at fault, and the server keeps serving
    for body, status, param, message in (
        ({"lora_name": "gone", "lora_path": "/nowhere"}, 404, "lora_path", "/nowhere"),
        (
            {"lora_name": "attn", "lora_path": str(models[2]["all"][0])},
            400,
            "lora_name",
            "already been loaded",
        ),
        ({"lora_name": "x", "lora_path": "/nowhere", "extra": 1}, 400, "extra", "extra"),
        ({"lora_name": "", "lora_path": "/nowhere"}, 400, "lora_name", "must not be empty"),
        (
            {"lora_name": base, "lora_path": str(models[2]["all"][0])},
            400,
            "lora_name",
            "is the served model's name",
        ),
    ):
        answer = httpx.post(remote.url_for("v1", "load_lora_adapter"), json=body)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and message in error["message"], error
    unload = remote.url_for("v1", "unload_lora_adapter")
    assert httpx.post(unload, json={"lora_name": "mlp"}).status_code == 200
    assert httpx.post(unload, json={"lora_name": "mlp"}).status_code == 404
    assert "mlp" not in {card.id for card in client.models.list().data}
    assert _complete(client, "attn")[0]
    chat = client.chat.completions.create(
        model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "attn"


def test_a_qwen3_adapter_equals_transformers_with_it_merged(tmp_path, hf_gguf_tokenizer):
    """Qwen3 (q/k norms inside the attention, head_dim 32 while hidden/heads is 16): an adapter
    on every projection, greedy, equal to transformers with it merged."""
    base_dir, base = build_checkpoint("qwen3", tmp_path / "base", hf_gguf_tokenizer, seed=5)
    config = dict(target_modules=[*ADAPTERS["mlp"]["target_modules"], "q_proj", "o_proj"], r=8)
    peft_model = _adapter(base, config, seed=20)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    llm = LLM(model=str(base_dir), enable_lora=True, **KWARGS)
    request = LoRARequest("q", 1, str(tmp_path / "adapter"))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=request)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(merged, prompt)


def test_an_adapter_on_int4_weights_adds_to_them_exactly(models, tmp_path):
    """On ``--quantization int4`` base weights the adapter's float32 delta is added to the int4
    matmul's output: an adapter whose B is zero leaves the tokens and log-probabilities bit for
    bit; a trained one changes them (its delta's values are the float tests' above)."""
    from safetensors.torch import load_file, save_file

    base_dir, _, adapters = models
    zero = tmp_path / "zero"
    zero.mkdir()
    source = adapters["all"][0]
    (zero / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    tensors = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}
    save_file(tensors, str(zero / "adapter_model.safetensors"))
    llm = LLM(model=str(base_dir), enable_lora=True, quantization="int4", **KWARGS)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base_out = [_tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)]
    zero_out = llm.generate(prompts, GREEDY, lora_request=LoRARequest("zero", 1, str(zero)))
    assert [_tokens_and_logprobs(o) for o in zero_out] == base_out
    trained = llm.generate(prompts, GREEDY, lora_request=_request(models, "all", 2))
    assert [_tokens_and_logprobs(o)[0] for o in trained] != [t for t, _ in base_out]


def test_responses_and_messages_answers_name_the_adapter_they_ran(remote):
    import anthropic

    client = remote.openai_client()
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="attn", messages=messages, max_tokens=4, temperature=0
    )
    want = chat.choices[0].message.content
    response = client.responses.create(model="attn", input="hi", max_output_tokens=4, temperature=0)
    assert (response.model, response.output_text) == ("attn", want)
    # cut by max_output_tokens: the last event is response.incomplete, which the SDK's
    # stream helper does not take as an end
    events = client.responses.create(
        model="attn", input="hi", max_output_tokens=4, temperature=0, stream=True
    )
    assert [event.response.model for event in events if hasattr(event, "response")][-1] == "attn"
    claude = anthropic.Anthropic(base_url=remote.url_for(), api_key="x", max_retries=0)
    greedy = {"temperature": 0}  # the SDK has no temperature argument: an extra field
    message = claude.messages.create(
        model="attn", messages=messages, max_tokens=4, extra_body=greedy
    )
    assert (message.model, message.content[0].text) == ("attn", want)
    with claude.messages.stream(
        model="attn", messages=messages, max_tokens=4, extra_body=greedy
    ) as stream:
        assert stream.get_final_message().model == "attn"
