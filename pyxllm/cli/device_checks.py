"""``pyxllm check-device``: does this device compute what the CPU computes, with every runner?

Three checks, on the model of ``--model`` (default: the embedded SmolLM2-135M-Instruct):

1. logits: the last-position logits of one prompt, float32 on the device vs float32 on the CPU;
   pass when ``max |difference| <= --atol`` (default 1e-2, on logits of magnitude ~10-30) and
   the argmax agrees;
2. tokens: greedy tokens of a few prompts of different lengths (decode batches that need
   padding to a graph bucket), with each runner the device supports (``eager``, ``graph``,
   ``compile``), in ``--dtype`` (float32 unless given); pass when every runner's equal eager's;
3. throughput: decode tokens per second of ``--batch-size`` sequences with each runner
   (a figure, not a pass/fail).

On the CPU the logits check compares the CPU with itself, and ``graph`` replays TorchScript
traces of the decode step (``runners.graph.TraceCapture``). Prints one line per check; exit
status 0 when all pass, else 1.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

import torch

from pyxllm.config import EngineConfig
from pyxllm.engine.input_processor import TokensPrompt
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.platforms import resolve_platform
from pyxllm.sampling_params import SamplingParams

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Once upon a time there was a little fox who lived at the edge of a very large forest, and",
)
RUNNERS = ("eager", "graph", "compile")
KV_GIB = 0.5  # per engine, unless --kv-cache-memory says otherwise


def _engine(config: EngineConfig, **changes):
    kv = config.kv_cache_memory or KV_GIB
    return LLMEngine(dataclasses.replace(config, kv_cache_memory=kv, **changes))


def _release(engine) -> None:
    platform = engine.executor.driver.platform
    del engine
    gc.collect()
    platform.empty_cache()


@torch.inference_mode()
def prompt_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[vocab]`` (on the CPU) after the last of ``token_ids``: one prefill step
    through the engine's executor and runner, written to KV blocks 0.. (run it before requests)."""
    executor = engine.executor.driver
    block_size = executor.config.block_size
    blocks = list(range(-(-len(token_ids) // block_size)))
    seq = ScheduledSequence(
        "check", list(token_ids), 0, blocks, True, SamplingParams(temperature=0)
    )
    batch = InputBatch.build(SchedulerOutput([seq]), block_size, executor.device)
    hidden = executor.runner.execute(batch, executor.make_context)
    return (
        executor.model.compute_logits(hidden.index_select(0, batch.logits_indices))[0].float().cpu()
    )


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (batched), and the decode-phase time in seconds."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(engine.input_processor.process(f"check-{i}", TokensPrompt(ids), params))
    tokens: dict[str, list[int]] = {}
    platform, started = engine.executor.driver.platform, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        if started is None:  # after the first step (the prefill)
            platform.synchronize()
            started = time.perf_counter()
    platform.synchronize()
    return [tokens[f"check-{i}"] for i in range(len(prompts))], time.perf_counter() - started


def run_checks(args, config: EngineConfig, out=None) -> int:
    """Run the checks for ``config.device``; ``args`` carries ``max_tokens``, ``batch_size``,
    ``atol`` and ``runners`` (comma-separated). Returns the exit status."""
    out = out if out is not None else sys.stdout
    say = lambda text: (out.write(text + "\n"), out.flush())  # noqa: E731
    platform = resolve_platform(config.device)
    config = dataclasses.replace(config, device=platform.name, graph_backend="eager")
    wanted = [r.strip() for r in args.runners.split(",") if r.strip()]
    say(f"check-device: device {platform.name}, dtype {config.dtype}, runners {', '.join(wanted)}")
    ok = True

    cpu = _engine(config, device="cpu", dtype="float32")
    prompts = [cpu.tokenizer.encode(p) for p in PROMPTS]
    reference = prompt_logits(cpu, prompts[-1])
    _release(cpu)
    device = _engine(config, dtype="float32")
    logits = prompt_logits(device, prompts[-1])
    _release(device)
    diff = (logits - reference).abs().max().item()
    same_argmax = int(logits.argmax()) == int(reference.argmax())
    passed = diff <= args.atol and same_argmax
    ok &= passed
    say(
        f"logits  {'PASS' if passed else 'FAIL'}: float32 {platform.name} vs cpu, max |diff| "
        f"{diff:.2e} "
        f"(atol {args.atol:g}), argmax {'equal' if same_argmax else 'differs'}"
    )

    expected, reference_kind = None, None
    batch = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    for kind in wanted:
        if kind not in platform.runners:
            say(
                f"{kind:7} SKIP: not supported on {platform.name} (supported: "
                f"{', '.join(platform.runners)})"
            )
            continue
        start = time.perf_counter()
        engine = _engine(config, graph_backend=kind)
        tokens, _ = _generate(engine, prompts, args.max_tokens)  # compiles / warms up too
        ready = time.perf_counter() - start
        _, seconds = _generate(engine, batch, args.max_tokens)
        _release(engine)
        rate = len(batch) * (args.max_tokens - 1) / seconds
        if expected is None:
            expected, reference_kind = tokens, kind
        passed = tokens == expected
        ok &= passed
        say(
            f"{kind:7} {'PASS' if passed else 'FAIL'}: greedy tokens "
            f"{'equal' if passed else 'differ from'} "
            f"{reference_kind}'s ({len(prompts)} prompts x {args.max_tokens}); decode {rate:.1f} "
            "tok/s at batch "
            f"{len(batch)}; first run {ready:.1f} s"
        )
        if not passed:
            say(f"        expected {expected}\n        got      {tokens}")
    say("check-device: " + ("all checks passed" if ok else "FAILED"))
    return 0 if ok else 1
