"""Tensor parallelism across processes on the CPU (gloo).

Greedy tokens with tp=3 (SmolLM2, spawned workers) and tp=2 (tiny random Qwen3 and Qwen3-MoE)
equal tp=1; a model that does not split is refused naming its head counts; each rank reads only
its own slices of the checkpoint; the step plan survives its delta encoding; two ``pyxllm serve``
processes launched by hand (``--nnodes 2 --node-rank 0|1``) answer a chat request, and killing
the worker makes the server unhealthy and exit non-zero naming the rank; SIGTERM to rank 0 stops
its spawned workers; a worker whose master is unreachable gives up with a clear error.

The machine has 2 cores shared with other jobs: engines are few, prompts short, and every rank
runs one torch thread.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import signal
import subprocess
import sys
import time
from functools import partial

import httpx
import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.distributed.control import encode
from pyxllm.distributed.parallel_state import tp_state
from pyxllm.executor.messages import StopMessage, from_wire, to_wire
from pyxllm.executor.multiproc import MultiprocExecutor
from pyxllm.executor.plan_codec import PlanDecoder, PlanEncoder, tensor_from_wire
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.executor.uniproc import UniprocExecutor
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.weight_loading import load_weights
from pyxllm.multimodal_inputs import MultiModalFeatureSpec, PlaceholderRange
from pyxllm.sampling_params import StructuredOutputsParams
from pyxllm.weights import (
    LazyWeight,
    iter_weight_slices,
    iter_weights,
    load_model_config,
    resolve_model_source,
)
from tests.model_fixtures import build_checkpoint, build_hf_model, tiny_config
from tests.utils import RemoteServer, free_port, kill_mid_stream

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My phone number is"]
# the last prompt is constrained: the bitmask is rank 0's alone, the workers never see it
PARAMS = [
    GREEDY,
    GREEDY,
    SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3} [0-9]{4}"),
    ),
]
ENGINE = dict(dtype="float32", max_model_len=96, kv_cache_memory=0.05)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_gguf_tokenizer):
    """kind -> tiny random checkpoint directory (qwen3, qwen3_moe, granite)."""
    root = tmp_path_factory.mktemp("tp_models")
    return {
        kind: build_checkpoint(kind, root / kind, hf_gguf_tokenizer, seed=i)[0]
        for i, kind in enumerate(("qwen3", "qwen3_moe", "granite"))
    }


def greedy_tokens(model, tp: int, **engine) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS with ``tp`` ranks (and ``engine`` settings), and the engine's KV
    block count; the engine (and its workers) is shut down before returning.

    With ``distributed_executor_backend="ray"`` it checks that every rank has an actor, on a
    node of its own under ``ray_placement_strategy="STRICT_SPREAD"``."""
    llm = LLM(model=model, tensor_parallel_size=tp, **ENGINE, **engine)
    engine = llm.llm_engine
    executor, ray = engine.executor, engine.config.distributed_executor_backend == "ray"
    try:
        assert isinstance(executor, UniprocExecutor if tp == 1 else MultiprocExecutor)
        if tp > 1 and ray:
            assert list(executor.placement) == list(range(tp))
            if engine.config.ray_placement_strategy == "STRICT_SPREAD":
                assert len({info["node_id"] for info in executor.placement.values()}) == tp
        elif tp > 1:
            assert sorted(executor.procs) == list(range(1, tp))
            assert all(p.is_alive() for p in executor.procs.values())
        outs = llm.generate(PROMPTS, PARAMS)
        assert re.fullmatch(r"[0-9]{3} [0-9]{4}", outs[-1].outputs[0].text)
        return [list(o.outputs[0].token_ids) for o in outs], executor.num_kv_blocks
    finally:
        engine.shutdown()
        if tp > 1:
            assert all(p.exitcode == 0 for p in executor.procs.values())


def test_smollm2_tp3_greedy_equals_tp1():
    ref, ref_blocks = greedy_tokens(None, 1)
    got, blocks = greedy_tokens(None, 3)
    assert got == ref
    assert all(len(set(t)) >= 3 for t in ref)  # real continuations, not one repeated token
    # a rank holds 1 of the 3 KV heads, so the same per-rank budget holds 3x the blocks
    assert 3 * ref_blocks <= blocks <= 3 * ref_blocks + 2
    assert not multiprocessing.active_children()


def test_smollm2_tp3_on_the_stored_gguf_weights_greedy_equals_tp1():
    """``--quantization gguf`` (the default outside the suite): each rank keeps its rows, and
    the row-parallel layers their columns (192 of 576, 512 of 1536: whole groups of 32), of the
    file's Q4_1 and Q8_0 blocks."""
    ref, _ = greedy_tokens(None, 1, quantization="gguf")
    assert greedy_tokens(None, 3, quantization="gguf")[0] == ref
    assert not multiprocessing.active_children()


def test_a_k_quant_file_at_tp2_keeps_its_factored_scales_and_tp1s_tokens(
    tmp_path, hf_gguf_tokenizer
):
    """A Q4_K_M-like file (Q4_K, the value and down projections Q6_K), 512 wide: at TP=2 a
    row-parallel layer's columns on each rank are whole super-blocks (256 of 512), so every
    layer keeps its scales as the file factors them, and greedy decoding gives TP=1's
    tokens."""
    from gguf import GGMLQuantizationType as T

    from tests.weights.test_gguf_stored import llama_gguf

    config = tiny_config("llama", hidden_size=512)
    config.num_hidden_layers, config.intermediate_size = 2, 1024
    model = build_hf_model(config, seed=9)
    types = {name: T.Q4_K for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
    types |= {"attn_v": T.Q6_K, "ffn_down": T.Q6_K}
    path = llama_gguf(model, tmp_path / "tiny-q4_k_m.gguf", layer_types=[types, types])
    hf_gguf_tokenizer.save_pretrained(tmp_path / "tokenizer")
    kwargs = dict(tokenizer=str(tmp_path / "tokenizer"), quantization="gguf", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(model=str(path), tensor_parallel_size=tp, **kwargs)
        try:
            layer = llm.llm_engine.executor.driver.model.model.layers[0]  # rank 0's
            for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                assert module.scales_and_zeros.dtype == torch.uint8, (tp, module)
            outs = llm.generate(PROMPTS, params)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
        finally:
            llm.llm_engine.shutdown()
    assert tokens[1] == tokens[0]
    assert not multiprocessing.active_children()


def test_smollm2_tp3_w8a8_scores_the_prompt_like_float_tp1():
    """Under ``--quantization w8a8`` each rank rotates its shards by the same seeded matrices
    and quantizes its own slice of a row-parallel input, so tokens may differ from one rank's,
    but the model must stay the model: the log-probabilities of a prompt's tokens stay within
    W8A8's error of float32's (measured: max 0.56, mean 0.09, against a mean |logprob| of 2.1;
    ranks rotating differently would scramble the embedding sum)."""
    prompt = (
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin "
        "is the capital of Germany. def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scores = []
    for tp, quantization in ((1, None), (3, "w8a8")):
        llm = LLM(tensor_parallel_size=tp, quantization=quantization, **ENGINE)
        try:
            out = llm.generate([prompt], params)[0]
        finally:
            llm.llm_engine.shutdown()
        scores.append(
            torch.tensor(
                [
                    entry[token].logprob
                    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])
                ]
            )
        )
    diff = (scores[0] - scores[1]).abs()
    assert len(diff) > 40 and scores[0].abs().mean() > 1.0
    assert diff.max() < 1.5 and diff.mean() < 0.2, (diff.max().item(), diff.mean().item())
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_tiny_qwen3_tp2_greedy_equals_tp1(tiny, kind):
    ref, _ = greedy_tokens(str(tiny[kind]), 1)
    got, _ = greedy_tokens(str(tiny[kind]), 2)
    assert got == ref, kind
    assert len({tuple(t) for t in ref}) == len(PROMPTS)


def test_transformers_implementation_with_a_draft_model_tp2_greedy_equals_tp1(tiny):
    """Granite through --model-impl transformers (its TP plan's colwise/rowwise layers split),
    with a draft model split over the ranks too (rank 0 broadcasts its drafts; the workers
    compute logits at every draft position), at TP 2, gives the TP 1 engine's tokens without
    either."""
    spec = {"method": "draft_model", "model": str(tiny["qwen3"]), "num_speculative_tokens": 3}
    prompts = [*PROMPTS[:2], "a b c d a b c d a b c", "1 2 3 1 2 3 1 2"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for tp, extra in ((1, {}), (2, {"speculative_config": spec, "model_impl": "transformers"})):
        llm = LLM(str(tiny["granite"]), tensor_parallel_size=tp, **ENGINE, **extra)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if tp > 1:
                assert llm.llm_engine.metrics.num_spec_draft_tokens > 0
        finally:
            llm.llm_engine.shutdown()
    assert outs[2] == outs[1]
    assert len({tuple(t) for t in outs[1]}) == len(prompts)


def test_smollm2_tp2_is_refused_naming_the_head_counts():
    with pytest.raises(ValueError) as e:
        LLM(tensor_parallel_size=2, **ENGINE)
    message = str(e.value)
    assert "--tensor-parallel-size 2: does not fit" in message
    assert "9 attention heads" in message and "3 KV heads" in message
    assert not multiprocessing.active_children()  # refused before any worker started


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    """tp=4 over 4 query heads and 2 KV heads: rank r holds query head r and KV head r // 2, the
    one query head r uses at tp=1 (grouped-query attention pairs heads 0,1 and 2,3 with KV 0 and
    1)."""
    from pyxllm.layers.linear import QKVParallelLinear

    head_dim, hidden = 8, 16
    q, k, v = (
        torch.randn(4 * head_dim, hidden),
        torch.randn(2 * head_dim, hidden),
        torch.randn(2 * head_dim, hidden),
    )
    for rank in range(4):
        with tp_state(rank, 4):
            layer = QKVParallelLinear(hidden, head_dim, 4, 2)
        for shard, full in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, full, shard)
        assert (layer.num_heads, layer.num_kv_heads, layer.kv_replicas) == (1, 1, 2)
        got_q, got_k, got_v = layer.weight.data.split(head_dim)
        head, kv_head = (
            slice(rank * head_dim, (rank + 1) * head_dim),
            slice(rank // 2 * head_dim, (rank // 2 + 1) * head_dim),
        )
        assert (
            torch.equal(got_q, q[head])
            and torch.equal(got_k, k[kv_head])
            and torch.equal(got_v, v[kv_head])
        )
    with (
        tp_state(0, 3),
        pytest.raises(
            ValueError,
            match="--tensor-parallel-size 3: does not fit 4 attention heads and 2 KV heads",
        ),
    ):
        QKVParallelLinear(hidden, head_dim, 4, 2)


def _load_rank(
    model_cls, model_config, source, weights, rank: int, tp: int
) -> dict[str, torch.Tensor]:
    with tp_state(rank, tp):
        model = model_cls(model_config)
        load_weights(model, weights)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "which, rank, tp", [("qwen3", 1, 2), ("qwen3_moe", 1, 2), ("smollm2_gguf", 2, 3)]
)
def test_a_rank_reads_only_its_slices(tiny, monkeypatch, which, rank, tp):
    """Loading through unread slices gives the parameters that narrowing full tensors gives,
    while reading about 1/tp of the checkpoint (norms and replicated KV heads aside)."""
    source = resolve_model_source(None if which == "smollm2_gguf" else str(tiny[which]))
    model_config = load_model_config(source)
    model_cls = resolve_model_class(model_config, "cpu")
    full = _load_rank(model_cls, model_config, source, iter_weights(source, model_config), rank, tp)
    total = sum(w.numel() for _, w in iter_weight_slices(source, model_config))
    read = []
    original = LazyWeight.load
    monkeypatch.setattr(
        LazyWeight, "load", lambda self: read.append(self.numel()) or original(self)
    )
    sliced = _load_rank(
        model_cls, model_config, source, iter_weight_slices(source, model_config), rank, tp
    )
    assert full.keys() == sliced.keys()
    for name in full:
        torch.testing.assert_close(sliced[name], full[name], atol=0, rtol=0, msg=name)
    assert sum(read) < total * (1.15 / tp), (sum(read), total)


def _seq(rid, tokens, computed, table, sample=True, drafts=0):
    return ScheduledSequence(rid, tokens, computed, table, sample, GREEDY, num_draft_tokens=drafts)


def test_plan_codec_sends_deltas_and_round_trips():
    encoder, decoder = PlanEncoder(), PlanDecoder()
    steps = [
        [_seq("a", list(range(20)), 0, [3, 4]), _seq("b", [7, 8, 9], 0, [5], sample=False)],
        [_seq("a", [42], 20, [3, 4]), _seq("b", [10], 3, [5])],  # decode, chunk end
        [_seq("a", [43], 21, [3, 4]), _seq("b", [11], 4, [5])],  # decode, nothing new
        [_seq("a", [44], 22, [3, 4, 9]), _seq("c", [1, 2], 0, [6])],  # a crosses a block, b gone
        [
            _seq("b", [7, 8, 9, 10, 11, 12], 0, [8, 2]),
            _seq("a", [45], 0, [3, 4, 9, 1]),
        ],  # b recomputed; a reset
        [_seq("a", [46, 1, 2, 3], 1, [3, 4, 9, 1, 7], drafts=3)],  # a with 3 speculative drafts
        [_seq("a", [47], 3, [3, 4, 9, 1])],  # 1 accepted: the block for the drafts was freed
    ]
    sizes = []
    for plan in map(SchedulerOutput, steps):
        wire = encode(to_wire(encoder.encode(plan)))  # what the control channel sends
        sizes.append(len(wire))
        got = decoder.decode(from_wire(json.loads(wire)))
        fields = ("token_ids", "num_computed_tokens", "block_table", "sample", "num_draft_tokens")
        assert [[getattr(s, f) for f in fields] for s in got.sequences] == [
            [getattr(s, f) for f in fields] for s in plan.sequences
        ]
    handles = [s[0] for s in encoder.encode(SchedulerOutput(steps[4])).sequences]
    assert len(set(handles)) == 2
    decode_step = encoder.encode(
        SchedulerOutput([_seq("b", [13], 6, [8, 2]), _seq("a", [46], 1, [3, 4, 9, 1])])
    ).sequences
    assert [keep for _, _, _, _, keep, *_ in decode_step] == [2, 4]  # b's table, a's table
    assert all(new == [] and computed == -1 for _, _, computed, _, _, new, *_ in decode_step)
    shrunk = encoder.encode(SchedulerOutput([_seq("a", [47], 3, [3, 4, 9])])).sequences
    assert shrunk[0][4:6] == (3, [])  # a shorter table keeps the common prefix
    assert sizes[2] < 70 < sizes[0]  # a decode step: ~30 bytes per sequence
    table = list(range(100, 150))  # a long context: the decode step does not resend its table
    encoder.encode(SchedulerOutput([_seq("long", list(range(790)), 0, table)]))
    long_decode = encoder.encode(SchedulerOutput([_seq("long", [5], 790, table)]))
    assert len(encode(to_wire(long_decode))) < 40
    assert from_wire(json.loads(encode(to_wire(StopMessage())))) == StopMessage()
    with pytest.raises(ValueError, match="not a worker message"):
        from_wire(["run", "os.system"])


def test_plan_codec_sends_an_image_once_its_rank_0_cache_lacks_it():
    """A vision-language model's images cross with their encoder inputs (tensors of any wire
    dtype, bit for bit) while rank 0's encoder cache lacks them, and by hash alone after."""

    class Cache:
        def __init__(self):
            self.entries = {}

    pixels = torch.randn(1, 3, 8, 8)
    image = MultiModalFeatureSpec(
        "image",
        "abc",
        PlaceholderRange(2, 4),
        {"pixel_values": pixels, "mask": torch.tensor([[True, False]]), "h": pixels.bfloat16()},
    )
    cache = Cache()
    encoder, decoder = PlanEncoder(cache), PlanDecoder()
    seq = _seq("a", list(range(8)), 0, [1])
    seq.mm_features = [image]
    wire = encode(to_wire(encoder.encode(SchedulerOutput([seq]))))
    [got] = decoder.decode(from_wire(json.loads(wire))).sequences
    [sent] = got.mm_features
    assert (sent.identifier, sent.modality, sent.mm_position) == ("abc", "image", image.mm_position)
    assert sent.data.keys() == image.data.keys()
    assert all(torch.equal(sent.data[k], image.data[k]) for k in image.data)
    assert all(sent.data[k].dtype == image.data[k].dtype for k in image.data)
    cache.entries = {"abc": None}  # rank 0 encoded it: the next chunk names it only
    seq = _seq("a", [8, 9], 8, [1])
    seq.mm_features = [image]
    [got] = decoder.decode(encoder.encode(SchedulerOutput([seq]))).sequences
    assert got.mm_features[0].identifier == "abc" and got.mm_features[0].data == {}
    with pytest.raises(ValueError, match="dtype"):
        tensor_from_wire(["complex64", [1], ""])


def test_plan_codec_carries_mrope_positions():
    """An mRoPE model's step positions ``[3, n]`` cross as they are (a decode's too); a
    sequence without them gets none."""
    encoder, decoder = PlanEncoder(), PlanDecoder()
    chunk = _seq("a", list(range(5)), 0, [1])
    chunk.mrope_positions = torch.tensor([[0, 1, 2, 2, 2], [0, 1, 2, 2, 3], [0, 1, 2, 3, 2]])
    text = _seq("b", [7, 8], 0, [2])
    got = decoder.decode(
        from_wire(json.loads(encode(to_wire(encoder.encode(SchedulerOutput([chunk, text]))))))
    )
    assert torch.equal(got.sequences[0].mrope_positions, chunk.mrope_positions)
    assert got.sequences[1].mrope_positions is None
    decode = _seq("a", [9], 5, [1])
    decode.mrope_positions = torch.tensor([[3], [3], [3]])
    [got] = decoder.decode(encoder.encode(SchedulerOutput([decode]))).sequences
    assert torch.equal(got.mrope_positions, decode.mrope_positions)


def test_plan_codec_carries_bidirectional_ranges():
    """A Gemma 3 step's images attended bidirectionally cross as ``[start, end)`` pairs (with
    mRoPE positions or without); a sequence without them gets none."""
    encoder, decoder = PlanEncoder(), PlanDecoder()
    chunk = _seq("a", list(range(30)), 0, [1, 2])
    chunk.bidirectional_ranges = ((3, 19), (21, 25))
    text = _seq("b", [7, 8], 0, [3])
    got = decoder.decode(
        from_wire(json.loads(encode(to_wire(encoder.encode(SchedulerOutput([chunk, text]))))))
    )
    assert got.sequences[0].bidirectional_ranges == ((3, 19), (21, 25))
    assert got.sequences[0].mrope_positions is None
    assert got.sequences[1].bidirectional_ranges == ()


class _TwoNodes:
    """Rank 1 (``pyxllm serve --node-rank 1``: executor only) and rank 0 (the HTTP server)."""

    def __init__(self, model: str, log):
        self.master, self.log = f"127.0.0.1:{free_port()}", log
        common = [
            "--model",
            model,
            "--nnodes",
            "2",
            "--master-addr",
            self.master,
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "0.05",
            "--dist-init-timeout",
            "60",
        ]
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "pyxllm", "serve", "--node-rank", "1", *common],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.server = RemoteServer(
            ["--node-rank", "0", "--served-model-name", "tp", *common], startup_timeout=120
        )


@pytest.fixture(scope="module")
def two_nodes(tiny, tmp_path_factory):
    with open(tmp_path_factory.mktemp("rank1") / "log", "w+b") as log:
        nodes = _TwoNodes(str(tiny["qwen3"]), log)
        try:
            with nodes.server:
                yield nodes
        finally:
            if nodes.worker.poll() is None:
                nodes.worker.kill()
            nodes.worker.wait(timeout=10)


def test_manual_two_process_launch_answers_a_chat(two_nodes):
    client = two_nodes.server.openai_client()
    response = client.chat.completions.create(
        model="tp", messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=8
    )
    assert response.choices[0].message.content
    assert response.usage.completion_tokens == 8
    assert two_nodes.worker.poll() is None  # rank 1 is serving, not exited
    assert httpx.get(two_nodes.server.url_for("health")).status_code == 200


def test_killed_worker_makes_the_server_unhealthy_and_exit(two_nodes):
    """docs/parallelism.md, "Tensor parallelism": if a worker dies, the in-flight request
    fails, ``/health`` answers 503 (naming the rank) for about a second, then the server exits
    with status 1 naming the rank."""
    server = two_nodes.server
    kill = partial(two_nodes.worker.send_signal, signal.SIGKILL)
    unhealthy = kill_mid_stream(server, kill, "TP worker rank 1")
    assert server.proc.poll() == 1
    assert unhealthy and all("TP worker rank 1 died" in m for m in unhealthy), unhealthy
    output = server.output()
    assert "TP worker rank 1 died" in output, output[-3000:]


def test_sigterm_on_rank0_stops_its_spawned_workers(tiny):
    server = RemoteServer(
        [
            "--model",
            str(tiny["qwen3"]),
            "--tp",
            "2",
            "--max-model-len",
            "96",
            "--kv-cache-memory",
            "0.05",
        ],
        startup_timeout=120,
    )
    with server:
        children = _children(server.proc.pid)
        assert len(children) >= 1
    assert server.proc.returncode == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_worker_gives_up_on_an_unreachable_master(capsys):
    """``pyxllm serve --node-rank 1`` (run in-process: the CLI's own code path) with nothing at the
    master address exits 1 with one line naming the rank, the address and the timeout."""
    from pyxllm.cli.main import main

    port = free_port()  # nothing listens there
    started = time.monotonic()
    code = main(
        [
            "serve",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            f"127.0.0.1:{port}",
            "--dist-init-timeout",
            "2",
        ]
    )
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert f"error: rank 1 could not reach the master address 127.0.0.1:{port} within 2 s" in err
    assert "Traceback" not in err
    assert 2 <= elapsed < 10


def test_gguf_slices_of_quantized_experts_equal_the_full_tensor(tmp_path, monkeypatch):
    """Row ranges, block-aligned and unaligned column ranges of one expert of a stacked Q8_0
    tensor read the same values as dequantizing it whole (and aligned reads touch fewer bytes)."""
    import gguf
    import numpy as np

    from pyxllm.weights import gguf_reader
    from pyxllm.weights.gguf_loader import iter_gguf_weight_slices

    stacked = (
        np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)
    )  # [E, out, in]
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 2)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    quantized = gguf.quants.quantize(stacked, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor(
        "blk.0.ffn_down_exps.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    full = torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
    weights = dict(iter_gguf_weight_slices(path))
    expert = weights["model.layers.0.mlp.experts.2.down_proj.weight"]
    assert expert.shape == (8, 64)
    torch.testing.assert_close(expert.load(), full[2], atol=0, rtol=0)
    for dim, start, length in (
        (0, 4, 4),
        (1, 32, 32),
        (1, 8, 20),
    ):  # rows; aligned cols; unaligned cols
        torch.testing.assert_close(
            expert.narrow(dim, start, length).load(),
            full[2].narrow(dim, start, length),
            atol=0,
            rtol=0,
        )
    with pytest.raises(ValueError, match="outside"):
        expert.narrow(1, 60, 8)
    # raw bytes handed to dequantize: an aligned column half reads half of each row
    dequantized = []
    original = gguf_reader.dequantize
    monkeypatch.setattr(
        gguf_reader,
        "dequantize",
        lambda raw, qtype: dequantized.append(raw.shape) or original(raw, qtype),
    )
    expert.narrow(0, 4, 4).narrow(1, 32, 32).load()
    assert dequantized == [(4, 34)]  # 4 rows x one 34-byte Q8_0 block (a whole row is 68 bytes)


def test_parallel_flags_and_their_errors(capsys):
    from pyxllm.cli.main import parse_args

    _, config = parse_args(["serve", "--tp", "3"])
    assert (config.tensor_parallel_size, config.world_size, config.nnodes) == (3, 3, 1)
    _, config = parse_args(
        ["serve", "--nnodes", "2", "--node_rank", "1", "--master_node_addr", "10.0.0.1:19888"]
    )
    assert (config.world_size, config.node_rank, config.master_addr) == (2, 1, "10.0.0.1:19888")
    for argv, named in (
        (["--nnodes", "2"], "--master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h:1"], "--node-rank"),
        (["--nnodes", "2", "--tp", "3", "--master-addr", "h:1"], "--tensor-parallel-size"),
        (["--master-addr", "localhost"], "host:port"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["serve", *argv])
        assert named in capsys.readouterr().err, argv
