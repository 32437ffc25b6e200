"""The CPU steps' thread count (``pyxllm.executor.thread_tuner``) and ``--graph-backend auto``.

The tuner on a clock that the test drives: it keeps the faster count, moves when the other one
becomes faster (a busy core), probes less often while nothing changes, and leaves prefill steps
alone. Its premise, that a step's results do not depend on the thread count, is checked on the
engine: greedy tokens and their logprobs bit for bit at 1 and 2 threads, on the stored GGUF
weights and dequantized.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.executor import model_executor
from pyxllm.executor.runners import DEFAULT_ENV, resolve_runner
from pyxllm.executor.thread_tuner import ENV, ThreadTuner, make_thread_tuner
from pyxllm.platforms import cpu


class Machine:
    """A clock whose steps take ``cost[threads]`` seconds."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.threads = cost, 0.0, None

    def clock(self) -> float:
        return self.now

    def run(self, tuner: ThreadTuner, steps: int, key: int | None = 1) -> list[int]:
        """``steps`` steps through ``tuner.step``; the thread count of each."""
        used = []
        for _ in range(steps):
            with tuner.step(key) as threads:
                self.now += self.cost[threads]
            used.append(threads)
        return used


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_the_faster_count_stays_and_probes_thin_out(restore_threads):
    machine = Machine({2: 1.0, 1: 1.6})  # quiet: two threads win
    tuner = ThreadTuner(2, probe_steps=4, interval=8, max_interval=64, clock=machine.clock)
    used = machine.run(tuner, 400)
    assert tuner.current == 2 and tuner.switches == 0
    assert used[:8] == [2] * 8 and used[8:12] == [1] * 4  # the first probe, after 8 steps
    assert tuner.interval == 64  # each probe that lost doubled the interval
    assert used.count(1) <= 4 * 7  # 8, 16, 32, then 64 steps apart


def test_a_busy_core_moves_it_to_one_thread_and_back(restore_threads):
    machine = Machine({2: 1.0, 1: 1.6})
    tuner = ThreadTuner(2, probe_steps=4, interval=8, max_interval=16, clock=machine.clock)
    machine.run(tuner, 40)
    machine.cost = {2: 3.5, 1: 1.6}  # another process takes one core
    used = machine.run(tuner, 40)
    assert tuner.current == 1 and tuner.switches == 1
    assert used[-10:].count(1) >= 6
    assert torch.get_num_threads() in (1, 2)
    machine.cost = {2: 1.0, 1: 1.6}  # quiet again
    machine.run(tuner, 60)
    assert tuner.current == 2 and tuner.switches == 2


def test_prefill_steps_run_at_the_current_count_untimed(restore_threads):
    machine = Machine({4: 1.0, 2: 0.5, 1: 2.0})
    tuner = ThreadTuner(4, probe_steps=2, interval=4, clock=machine.clock)
    assert tuner.candidates == [1, 2, 4]
    assert machine.run(tuner, 50, key=None) == [4] * 50
    assert not tuner.samples
    machine.run(tuner, 40)
    assert tuner.current == 2  # the faster neighbour, one halving down
    assert ThreadTuner(1).candidates == [1]
    assert machine.run(ThreadTuner(1, interval=2, clock=machine.clock), 10, key=3) == [1] * 10


def test_only_a_multi_threaded_cpu_rank_is_tuned(monkeypatch, restore_threads):
    import dataclasses

    torch.set_num_threads(2)
    monkeypatch.delenv(ENV, raising=False)
    host = cpu.load()
    assert isinstance(make_thread_tuner(host, 1), ThreadTuner)
    assert make_thread_tuner(dataclasses.replace(host, adaptive_threads=False), 1) is None
    assert make_thread_tuner(host, 2) is None
    monkeypatch.setenv(ENV, "0")
    assert make_thread_tuner(host, 1) is None
    torch.set_num_threads(1)
    monkeypatch.delenv(ENV)
    assert make_thread_tuner(host, 1) is None


def test_graph_backend_auto_is_the_graph_runner_on_the_cpu(monkeypatch):
    from pyxllm.config import EngineConfig

    platform = cpu.load()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    assert EngineConfig().graph_backend == "auto"
    assert resolve_runner("auto", model, platform) == "graph"
    assert resolve_runner("eager", model, platform) == "eager"
    model[0].capturable = False  # as MoE routing declares
    assert resolve_runner("auto", model, platform) == "eager"
    model[0].capturable = True
    model.model_impl = "transformers"
    assert resolve_runner("auto", model, platform) == "eager"
    monkeypatch.setenv(DEFAULT_ENV, "compile")
    assert resolve_runner("auto", model, platform) == "compile"
    monkeypatch.setenv(DEFAULT_ENV, "cudagraphs")
    with pytest.raises(ValueError, match="not supported on device cpu"):
        resolve_runner("auto", model, platform)


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_results_do_not_depend_on_the_thread_count(quantization, restore_threads, monkeypatch):
    """The tuner's premise: a 130-token prefill (BLAS GEMMs) and 24 decode steps of 3
    sequences give the same tokens and logprobs, bit for bit, at 1 and 2 threads. The weights
    load and pack on one thread (``one_thread``: its OpenMP regions stall on busy cores), and
    the count is restored after."""
    loading_threads = []
    load = model_executor.load_weights

    def load_weights(*args):
        loading_threads.append(torch.get_num_threads())
        return load(*args)

    monkeypatch.setattr(model_executor, "load_weights", load_weights)
    torch.set_num_threads(2)
    llm = LLM(
        quantization=quantization,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=0.05,
        enable_prefix_cache=False,
    )
    assert loading_threads == [1] and torch.get_num_threads() == 2
    prompts = ["Repeat: " + "the cat sat on the warm mat by the door " * 12, "Hello", "1, 2, 3"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    runs = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        runs.append(
            [
                [(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in llm.generate(prompts, params)
            ]
        )
    assert runs[0] == runs[1]
    assert all(len(r) == 24 for r in runs[0])


def test_embed_steps_are_tuned_by_their_token_count(monkeypatch, restore_threads):
    """The encoder's steps (``--task embed``) are timed too, each keyed by its token count
    rounded up to a power of two (every one is a prefill of its own length); the vectors do not
    depend on the thread count."""
    texts = ["The cat sits on the mat.", "Embeddings map text to vectors.", "Dogs bark."]
    monkeypatch.delenv(ENV, raising=False)
    torch.set_num_threads(2)
    llm = LLM(task="embed")
    tuner = llm.llm_engine.executor.thread_tuner
    assert isinstance(tuner, ThreadTuner)
    two = llm.embed(texts)
    tokens = sum(len(llm.llm_engine.tokenizer.encode(t)) for t in texts)
    assert set(tuner.samples) == {(2, 1 << (tokens - 1).bit_length())}
    tuner.current = 1
    for a, b in zip(two, llm.embed(texts)):
        assert torch.equal(a.outputs.data, b.outputs.data)


def test_adapter_steps_are_timed_apart_from_base_only_ones():
    """On a LoRA engine a decode step with adapter rows costs more than a base-only one of the
    same size: the tuner compares each only with its own kind; prefills are not timed."""
    from types import SimpleNamespace

    from pyxllm.executor.model_executor import tuner_key

    decode = SimpleNamespace(decodes_only=True, input_ids=torch.zeros(8))
    prefill = SimpleNamespace(decodes_only=False, input_ids=torch.zeros(40))
    assert tuner_key(decode, None) == 8
    assert tuner_key(decode, object()) == (8, "lora")
    assert tuner_key(prefill, object()) is None
    tuner = ThreadTuner(2, probe_steps=2, interval=2)
    tuner.record(8, 2, 0.010)
    tuner.record((8, "lora"), 2, 0.030)
    assert tuner.samples[(2, 8)] == deque([0.010]) and tuner.samples[(2, (8, "lora"))] == deque(
        [0.030]
    )
