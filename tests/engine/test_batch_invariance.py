"""``--batch-invariant`` (the default): a request's tokens do not depend on what else the engine
does. Random schedules (arrivals at random steps, prompts sharing prefixes of whole and partial
blocks, chunked prefills of any size, a KV cache small enough to preempt, ``n > 1``, greedy and
seeded sampling, the graph runner) on the embedded model's weights as stored (the default for
a GGUF), dequantized to float32 (a float checkpoint's default on a CPU without bfloat16) and to
bfloat16 (its default with avx512_bf16 or AMX), against each request run alone on an eager
engine with nothing cached: the same tokens and the same log-probabilities, bit for bit."""

from __future__ import annotations

import random

import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.engine.input_processor import TokensPrompt
from pyxllm.platforms.cpu import cpu_default_dtype
from tests.utils import RemoteServer, run_together

# a small cache (preemption), small steps (prefill chunks of many sizes, batches of more and
# fewer than 32 rows: the group kernels' GEMM threshold without --batch-invariant)
ENGINE = dict(
    max_model_len=256,
    max_tokens_per_batch=48,
    max_seqs_per_batch=8,
)


def _engines(quantization: str, dtype: str = "float32"):
    """``(busy, alone)``: one engine for the schedules (decode steps replayed from graph
    captures), one eager with no prefix cache for the requests run one by one; on the weights
    as stored (int4/int8 group kernels) or in float (the row-wise float32 or bfloat16 kernel),
    with a KV cache of 24 blocks of 16 tokens in ``dtype``."""
    itemsize = 2 if dtype == "bfloat16" else 4
    kwargs = dict(
        ENGINE,
        quantization=quantization,
        dtype=dtype,
        kv_cache_memory_bytes=24 * 16 * 30 * 2 * 3 * 64 * itemsize,
    )
    busy = LLM(graph_backend="graph", **kwargs).llm_engine
    alone = LLM(graph_backend="eager", enable_prefix_cache=False, **kwargs).llm_engine
    return busy, alone


@pytest.fixture(scope="module")
def engines():
    return _engines("gguf")


def _requests(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Eight requests: prompts of 3..120 tokens, half extending one of two shared stems (a
    whole block, and a block and a half), greedy or seeded sampling, some with ``n = 2``."""
    stems = [[rng.randrange(100, 49000) for _ in range(n)] for n in (16, 24)]
    requests = []
    for i in range(8):
        body = [rng.randrange(100, 49000) for _ in range(rng.randrange(3, 96))]
        prompt = (rng.choice(stems) + body) if i % 2 else body
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 20), logprobs=2)
        else:
            params = SamplingParams(
                temperature=0.9,
                top_p=0.95,
                seed=rng.randrange(1 << 30),
                n=rng.choice((1, 2)),
                max_tokens=rng.randrange(4, 20),
                logprobs=2,
            )
        params = params.replace(ignore_eos=True)
        requests.append((prompt, params))
    return requests


def _run(engine, requests, arrivals: list[int]) -> dict[str, list]:
    """Each request's samples, as ``(token id, {token id: log-probability})`` per token (the
    log-probabilities show any difference in the logits' bits, which the tokens rarely do),
    request ``i`` added at step ``arrivals[i]`` (or as soon as the engine idles)."""
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    outputs: dict[str, list[list[int]]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (arrivals[pending[0]] <= step or not engine.has_unfinished_requests()):
            i = pending.pop(0)
            prompt, params = requests[i]
            engine.add_request(
                engine.input_processor.process(f"r{i}", TokensPrompt(prompt), params)
            )
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [
                    [
                        (t, {k: v.logprob for k, v in top.items()})
                        for t, top in zip(o.token_ids, o.logprobs)
                    ]
                    for o in out.outputs
                ]
        step += 1
    return outputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedules_give_each_request_its_tokens_alone(engines, seed):
    busy, alone = engines
    before = busy.stats()
    _check_schedule(busy, alone, seed)
    stats = busy.stats()
    # the schedule did what it is for: prefix hits, preemptions (over the three schedules the
    # module's engine sees both; each alone is too short a run to be sure of a preemption)
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    if seed == 2:
        assert stats["num_preemptions"] > 0


def _check_schedule(busy, alone, seed: int) -> None:
    """Schedule ``seed``'s requests on ``busy``; each equals itself alone on ``alone``."""
    rng = random.Random(seed)
    requests = _requests(rng)
    got = _run(busy, requests, [rng.randrange(0, 6) for _ in requests])
    want = {f"r{i}": _run(alone, [request], [0])["r0"] for i, request in enumerate(requests)}
    assert got == want


def test_float32_weights_give_each_request_its_tokens_alone():
    """The same on the embedded model dequantized to float32 (the row-wise float32 kernel), on
    one schedule (each costs ~13 s on 2 cores; preemption is the scheduler's, tested above):
    prefill chunks and decode batches of many sizes, and prefix hits."""
    busy, alone = _engines("none")
    before = busy.stats()
    _check_schedule(busy, alone, 0)
    assert busy.stats()["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_bfloat16_weights_give_each_request_its_tokens_alone():
    """The same on the embedded model dequantized to bfloat16 (the row-wise bfloat16 kernel,
    bfloat16 attention, norms and KV cache), on one schedule, as float32 above. On oneDNN's
    bfloat16 GEMM (``--no-batch-invariant``'s matmuls) some of this schedule's requests
    differ (checked when the kernel was added)."""
    busy, alone = _engines("none", "bfloat16")
    before = busy.stats()
    _check_schedule(busy, alone, 0)
    assert busy.stats()["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_w8a8_gives_each_request_its_tokens_alone():
    """The same with ``--quantization w8a8`` in bfloat16: int8 activations and weights through
    oneDNN's integer GEMM (``torch._int_mm``), whose int32 sums are exact in any order, so a
    row's result does not depend on its batch without a kernel of ours; ``int4`` and ``int8``
    (the same LM head) gave the same when checked, on oneDNN's AVX-512 and AVX2 paths
    (``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    busy, alone = _engines("w8a8", "bfloat16")
    _check_schedule(busy, alone, 0)


def test_a_default_server_answers_a_request_the_same_every_time():
    """``pyxllm serve`` with every default (``--dtype auto``: bfloat16 on a CPU with avx512_bf16
    or AMX, float32 elsewhere; the GGUF's weights as stored; the graph runner): a chat at
    temperature 0 sent, sent again (a prefix-cache hit: its prefill runs over fewer rows),
    streamed, and streamed and unstreamed at once beside a longer request (a batch of three),
    gives the same tokens and log-probabilities each time. The suite's other servers run
    float32 and dequantized weights; this one runs what ``make serve`` runs."""
    defaults = {
        "PYXLLM_CPU_DEFAULT_DTYPE": "",
        "PYXLLM_DEFAULT_QUANTIZATION": "",
        "PYXLLM_DEFAULT_GRAPH_BACKEND": "",
    }
    args = ["--served-model-name", "m", "--max-model-len", "512", "--kv-cache-memory", "0.1"]
    with RemoteServer(args, env=defaults) as server:
        client = server.openai_client()
        text = "Écris une phrase en français sur l'été à Zürich, avec des accents."
        ask = dict(
            model="m",
            messages=[{"role": "user", "content": text}],
            temperature=0,
            max_tokens=40,
            logprobs=True,
        )

        def plain():
            reply = client.chat.completions.create(**ask)
            return [(e.token, e.logprob) for e in reply.choices[0].logprobs.content]

        def streamed():
            chunks = client.chat.completions.create(**ask, stream=True)
            return [
                (e.token, e.logprob)
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]

        def longer():
            story = "Tell me a long story about a fox who lives in the mountains."
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": story}], max_tokens=30
            )

        first = plain()
        assert len(first) > 10
        assert plain() == first
        assert streamed() == first
        again, again_streamed, _ = run_together(plain, streamed, longer)
        assert again == first
        assert again_streamed == first
        # it ran the defaults: this CPU's dtype, the weights as stored, the graph runner
        dtype = str(cpu_default_dtype(override="")).removeprefix("torch.")
        log = server.output()
        assert f"dtype {dtype}," in log
        assert "weights kept as the GGUF file stores them" in log
        assert "runner graph" in log
