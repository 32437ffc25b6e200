"""Runners: the ``--graph-backend`` spellings, the graph runner's buckets and padding (through
its eager stand-in), the CPU's traced graphs and compile, both with eager's greedy tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pyxllm.attention.abstract import AttentionBackend
from pyxllm.cli.main import parse_args
from pyxllm.config import GRAPH_BACKEND_ALIASES, EngineConfig
from pyxllm.entrypoints.llm import LLM
from pyxllm.executor.input_batch import InputBatch, segment_ids
from pyxllm.executor.runners import (
    CompileRunner,
    EagerCapture,
    EagerRunner,
    GraphRunner,
    TraceCapture,
    build_runner,
    capture_sizes,
)
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.kernels.cuda.paged_cache import reshape_and_cache as capturable_reshape_and_cache
from pyxllm.kernels.native import reshape_and_cache
from pyxllm.layers.forward_context import AttentionStep
from pyxllm.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a forest",
    "1 2 3",
]
LLM_KWARGS = dict(max_model_len=128, kv_cache_memory=0.05, max_seqs_per_batch=8)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def eager_llm():
    return LLM(**LLM_KWARGS)


@pytest.fixture(scope="module")
def eager_tokens(eager_llm):
    return [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS[:3], GREEDY)]


# --- the flag ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, kind",
    [
        ("eager", "eager"),
        ("off", "eager"),
        ("none", "eager"),
        ("compile", "compile"),
        ("inductor", "compile"),
        ("graph", "graph"),
        ("cudagraphs", "graph"),
        ("aclgraph", "graph"),
        ("CudaGraphs", "graph"),
        ("OFF", "eager"),
    ],
)
@pytest.mark.parametrize("form", ["--graph-backend", "--graph_backend"])
def test_every_graph_backend_spelling_is_read(spelling, kind, form):
    assert parse_args(["serve", form, spelling])[1].graph_backend == kind
    assert EngineConfig(graph_backend=spelling).graph_backend == kind


def test_every_alias_is_listed():
    assert set(GRAPH_BACKEND_ALIASES) == {
        "auto",
        "eager",
        "off",
        "none",
        "compile",
        "inductor",
        "graph",
        "cudagraphs",
        "aclgraph",
    }
    # resolved per model: tests/executor/test_thread_tuner.py
    assert EngineConfig().graph_backend == "auto"


def test_an_unknown_graph_backend_names_the_flag_and_the_spellings(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--graph-backend", "turbo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--graph-backend" in err and "'turbo'" in err
    for word in ("eager", "compile", "graph", "off", "none", "inductor", "cudagraphs", "aclgraph"):
        assert word in err


# --- buckets and padding -------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[1] * 8, [3, 1, 1], [2, 0, 3], [0, 4], [0, 0], []])
def test_segment_ids_equal_repeat_interleave(lengths):
    want = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)
    )
    got = segment_ids(lengths)
    assert got.dtype == torch.long and torch.equal(got, want)


def test_an_input_batch_of_a_prefill_chunk_and_decodes_lays_out_positions_and_slots():
    """Token positions continue each sequence's cached tokens; slots follow its block table."""
    params = SamplingParams()
    seqs = [
        ScheduledSequence("a", [7, 8, 9], 4, [3, 5], True, params),  # a chunk at positions 4..6
        ScheduledSequence("b", [1], 2, [6], True, params),  # a decode at position 2
    ]
    batch = InputBatch.build(SchedulerOutput(seqs), 4, torch.device("cpu"))
    assert batch.positions.tolist() == [4, 5, 6, 2]
    assert batch.slot_mapping.tolist() == [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 6 * 4 + 2]
    assert batch.query_start_loc.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [7, 3]
    assert batch.logits_indices.tolist() == [2, 3] and not batch.decodes_only


def test_an_input_batch_pads_block_tables_and_samples_a_drafting_sequences_last_rows():
    """Block tables of different lengths are padded with block 0; a sequence verifying two
    drafts is sampled at its last three tokens, one that does not sample at none; every index
    tensor is int64."""
    params = SamplingParams()
    seqs = [
        ScheduledSequence("a", [4, 5, 6], 9, [2, 8, 1], True, params, num_draft_tokens=2),
        ScheduledSequence("b", [1, 2], 0, [7], False, params),  # a prefill chunk, not sampled
        ScheduledSequence("c", [3], 5, [4, 9], True, params),
    ]
    batch = InputBatch.build(SchedulerOutput(seqs), 4, torch.device("cpu"))
    assert batch.block_tables.tolist() == [[2, 8, 1], [7, 0, 0], [4, 9, 0]]
    assert batch.positions.tolist() == [9, 10, 11, 0, 1, 5]
    assert batch.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 28, 29, 9 * 4 + 1]
    assert batch.input_ids.tolist() == [4, 5, 6, 1, 2, 3]
    assert batch.logits_indices.tolist() == [0, 1, 2, 5]
    assert batch.seq_lens.tolist() == [12, 2, 6] and batch.query_start_list == [0, 3, 5, 6]
    tensors = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens")
    for name in (*tensors, "block_tables", "logits_indices"):
        assert getattr(batch, name).dtype == torch.long, name


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(128)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(128)[-1] == 128
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def fake_batch(query_lens, seq_len=10, prefill=False, mrope=False):
    """What ``bucket_for`` reads of an ``InputBatch``: each sequence decodes (a token, or a
    token and its drafts), or with ``prefill`` each multi-token one is a prefill chunk; with
    ``mrope``, the step has mRoPE positions."""
    drafts = [0 if prefill else n - 1 for n in query_lens]
    total = sum(query_lens)
    return SimpleNamespace(
        query_lens=list(query_lens),
        seq_lens_list=[seq_len] * len(query_lens),
        num_draft_tokens=drafts,
        decodes_only=all(n == 1 + d for n, d in zip(query_lens, drafts)),
        mrope_positions=torch.zeros(3, total, dtype=torch.long) if mrope else None,
    )


def test_bucket_choice(eager_llm):
    executor = eager_llm.llm_engine.executor.driver
    runner = GraphRunner(
        executor.model, executor.attn_backend, executor.kv_caches, 64, 128, 16, EagerCapture()
    )
    assert runner.sizes == [1, 2, 4, 8, 16, 32, 48, 64]
    for n, size in [
        (1, 1),
        (2, 2),
        (3, 4),
        (5, 8),
        (8, 8),
        (9, 16),
        (17, 32),
        (33, 48),
        (49, 64),
        (64, 64),
    ]:
        assert runner.bucket_for(fake_batch([1] * n)) == size, n
    assert runner.bucket_for(fake_batch([1] * 65)) is None  # more than the largest bucket
    assert runner.bucket_for(fake_batch([1, 5, 1], prefill=True)) is None  # a prefill chunk
    assert runner.bucket_for(fake_batch([1, 1], seq_len=129)) is None  # longer than captured
    # an mRoPE model's decodes of image requests: the captures read the tokens' indices
    assert runner.bucket_for(fake_batch([1, 1], mrope=True)) is None
    runner.max_query_len = 5  # speculative decoding with 4 drafts: a row per token
    assert runner.bucket_for(fake_batch([1, 5, 1])) == 8
    assert runner.bucket_for(fake_batch([5] * 12 + [4])) == 64
    assert runner.bucket_for(fake_batch([5] * 13)) is None  # 65 rows
    # a prompt of 5 tokens is no verification: eager, through the prefill kernel, as without
    # speculation (its first token's logits then equal those of an engine without drafts)
    assert runner.bucket_for(fake_batch([5], prefill=True)) is None
    assert runner.bucket_for(fake_batch([1, 6])) is None  # a longer query: a prefill


def test_capturable_cache_write_equals_the_native_one():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache, v_cache = torch.randn(4, 4, 2, 8).to(dtype), torch.randn(4, 4, 2, 8).to(dtype)
        key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
        for slots in ([3, 0, -1, 9, -1], [-1, -1, 4, -1, -1], [0, 1, 2, 3, 15], [-1] * 5):
            slots = torch.tensor(slots)
            native, capturable = (
                (k_cache.clone(), v_cache.clone()),
                (k_cache.clone(), v_cache.clone()),
            )
            reshape_and_cache(key, value, *native, slots)
            capturable_reshape_and_cache(key, value, *capturable, slots)
            assert torch.equal(native[0], capturable[0]) and torch.equal(native[1], capturable[1])


def decode_batch(executor, lens: list[int]) -> InputBatch:
    """Prefill sequences of ``lens`` tokens (in the cache's last blocks, which the engine's short
    requests never reach), then return the decode batch of their next token."""
    block_size = executor.config.block_size
    seqs, first_block = [], executor.num_kv_blocks - sum(n // block_size + 1 for n in lens)
    for i, n in enumerate(lens):
        blocks = list(range(first_block, first_block + n // block_size + 1))
        first_block = blocks[-1] + 1
        ids = [(7 * i + 13 * j) % 1000 + 10 for j in range(n)]
        seqs.append(ScheduledSequence(f"s{i}", ids, 0, blocks, True, GREEDY))
    executor.execute(SchedulerOutput(seqs))
    decodes = [
        ScheduledSequence(s.request_id, [42 + i], len(s.token_ids), s.block_table, True, GREEDY)
        for i, s in enumerate(seqs)
    ]
    return InputBatch.build(SchedulerOutput(decodes), block_size, executor.device)


def test_the_backend_and_its_steps_satisfy_the_attention_protocols(eager_llm):
    executor = eager_llm.llm_engine.executor.driver
    backend, batch = executor.attn_backend, decode_batch(executor, [5, 20])
    assert isinstance(backend, AttentionBackend)
    decode = backend.build_decode(batch.slot_mapping, batch.block_tables, batch.seq_lens, 32)
    for step in (backend.build(batch), decode, executor.make_context(batch).attn):
        assert isinstance(step, AttentionStep)


def test_padding_through_the_eager_stand_in(eager_llm):
    executor = eager_llm.llm_engine.executor.driver
    batch = decode_batch(executor, [5, 20, 9])
    runner = GraphRunner(
        executor.model, executor.attn_backend, executor.kv_caches, 8, 128, 16, EagerCapture()
    )
    assert runner.bucket_for(batch) == 4

    runner.pad_inputs(batch, 4)
    assert runner.input_ids[:4].tolist() == [*batch.input_ids.tolist(), 0]
    assert runner.positions[:4].tolist() == [5, 20, 9, 0]
    assert runner.slot_mapping[:4].tolist() == [*batch.slot_mapping.tolist(), -1]
    assert runner.seq_lens[:4].tolist() == [6, 21, 10, 1]
    width = batch.block_tables.shape[1]
    assert torch.equal(runner.block_tables[:3, :width], batch.block_tables)
    assert not runner.block_tables[3].any() and not runner.block_tables[:3, width:].any()

    before = [(k.clone(), v.clone()) for k, v in executor.kv_caches]
    hidden = runner.execute(batch, executor.make_context)
    assert runner.replays[4] == 1
    after = [(k.clone(), v.clone()) for k, v in executor.kv_caches]
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        changed = (k0 != k1).flatten(0, 1).any(-1).any(-1) | (v0 != v1).flatten(0, 1).any(-1).any(
            -1
        )
        assert set(changed.nonzero().flatten().tolist()) <= set(batch.slot_mapping.tolist()), layer

    for (k, v), (k0, v0) in zip(
        executor.kv_caches, before
    ):  # the unpadded eager run, from the same cache
        k.copy_(k0)
        v.copy_(v0)
    expected = EagerRunner(executor.model).execute(batch, executor.make_context)
    assert hidden.shape == expected.shape == (3, executor.model_config.hidden_size)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    for (k, v), (k1, v1) in zip(executor.kv_caches, after):
        torch.testing.assert_close(k, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v1, rtol=1e-5, atol=1e-5)


def test_graph_stand_in_gives_eager_tokens(eager_llm, eager_tokens):
    executor = eager_llm.llm_engine.executor.driver
    saved = executor.runner
    runner = GraphRunner(
        executor.model, executor.attn_backend, executor.kv_caches, 8, 128, 16, EagerCapture()
    )
    executor.runner = runner
    try:
        tokens = [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS[:3], GREEDY)]
        single = eager_llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    finally:
        executor.runner = saved
    assert tokens == eager_tokens
    assert single == eager_tokens[0]
    assert (
        runner.replays[4] >= GREEDY.max_tokens - 1
    )  # 3 sequences decoded in bucket 4, not eagerly
    assert runner.replays[1] >= GREEDY.max_tokens - 1


def test_cpu_graph_replays_traced_decode_steps_with_eager_tokens(eager_tokens):
    """On the CPU, ``--graph-backend graph`` records each bucket's decode step with TorchScript;
    its replays must write the real KV cache (checked by the tokens of later steps)."""
    llm = LLM(graph_backend="cudagraphs", **LLM_KWARGS)
    runner = llm.llm_engine.executor.driver.runner
    assert isinstance(runner, GraphRunner) and runner.sizes == [1, 2, 4, 8]
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    single = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    assert tokens == eager_tokens and single == eager_tokens[0]
    # a constrained row's mask applies to the replayed step's logits as to eager ones
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    constrained = SamplingParams(temperature=0, max_tokens=5, structured_outputs=choice)
    assert llm.generate(PROMPTS[0], constrained)[0].outputs[0].text in ("alpha beta", "gamma")
    assert runner.replays[4] >= GREEDY.max_tokens - 1 and runner.replays[1] >= GREEDY.max_tokens - 1


@pytest.mark.parametrize("quantization", ["int4", "w8a8"])
def test_cpu_graph_gives_eager_tokens_with_quantized_linears(quantization):
    """The quantized matmuls (ATen's int4 kernel; the fused W8A8 op with its per-token scales,
    which padding rows must not disturb) replay from the traces as they run eagerly."""
    prompts = PROMPTS[:3]
    eager = LLM(quantization=quantization, **LLM_KWARGS)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    llm = LLM(quantization=quantization, graph_backend="graph", **LLM_KWARGS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.llm_engine.executor.driver.runner.replays[4] >= GREEDY.max_tokens - 1


def test_graph_refuses_what_a_capture_cannot_record(eager_llm, monkeypatch):
    executor = eager_llm.llm_engine.executor.driver
    monkeypatch.setattr(type(executor.model.model.norm), "capturable", False, raising=False)
    with pytest.raises(
        ValueError, match=r"cannot capture LlamaForCausalLM: its RMSNorm runs Python on the data"
    ):
        GraphRunner(
            executor.model, executor.attn_backend, executor.kv_caches, 8, 128, 16, EagerCapture()
        )
    monkeypatch.undo()
    monkeypatch.setattr("pyxllm.executor.runners.get_tp_size", lambda: 2)
    with pytest.raises(ValueError, match=r"cannot record collectives: use it with --tp 1"):
        build_runner(
            "graph",
            executor.model,
            executor.platform,
            executor.attn_backend,
            executor.kv_caches,
            8,
            128,
            16,
        )


# --- compile -------------------------------------------------------------------------------


def test_compile_gives_eager_tokens_on_smollm2(eager_tokens):
    llm = LLM(graph_backend="inductor", **LLM_KWARGS)
    runner = llm.llm_engine.executor.driver.runner
    assert isinstance(runner, CompileRunner)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    assert tokens == eager_tokens
    # single-token steps reuse the same graph (the token dimension is unbacked-dynamic)
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == eager_tokens[0]


def test_compile_runs_the_defaults_with_eager_tokens_and_logprobs():
    """The default model as a user runs it, its weights kept as the GGUF file stores them (the
    tied embedding read out of the LM head's int8 tiles, whose indexing inductor could not
    compile over the unbacked token count) in bfloat16, compiles too, with eager's tokens and
    logprobs to the bit (inductor kept float32 between fused ops and left eager's greedy path
    after a few tokens, until the runner asked it to round where eager rounds)."""
    kwargs = dict(LLM_KWARGS, quantization="gguf", dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)

    def outputs(llm):
        return [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS[:2], params)
        ]

    expected = outputs(LLM(**kwargs))
    import torch._dynamo

    torch._dynamo.reset()  # the graph count below is this model's alone, whatever ran before
    llm = LLM(graph_backend="compile", **kwargs)
    assert isinstance(llm.llm_engine.executor.driver.runner, CompileRunner)
    assert outputs(llm) == expected
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    # single-token steps (one prompt) share the graphs: the embedding's rows, looked up outside
    # them, were specialized at 2 or more tokens, and the first such step compiled again (~30 s)
    assert len(llm.generate(PROMPTS[2:3], params)[0].outputs[0].token_ids) == 24
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs


def test_a_trace_is_taken_on_one_thread_and_replays_on_the_callers():
    """Captures run on one torch thread (OpenMP regions on cores another process keeps busy
    stalled start-up ~10x); the count is restored, and a replay gives the traced results."""
    seen = []

    def step(x):
        seen.append(torch.get_num_threads())
        return x * 2 + 1

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        replay = TraceCapture().capture(step, (torch.ones(3),))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        assert torch.equal(replay((torch.arange(3.0),)), torch.tensor([1.0, 3.0, 5.0]))
    finally:
        torch.set_num_threads(before)
