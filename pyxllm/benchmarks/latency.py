"""``pyxllm bench latency``: one request at a time (batch 1).

Runs ``--num-iters`` requests (after ``--num-iters-warmup``), driving the engine step by step:
the time to the first token (the prefill of ``--input-len`` tokens) and the decode rate of the
remaining ``--output-len - 1`` tokens. Each request has a prompt of its own, so the prefix cache
(when on) serves none of it and the time to the first token is a whole prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pyxllm.benchmarks.report import write_json
from pyxllm.benchmarks.throughput import _config_kwargs, _token_prompts
from pyxllm.engine.input_processor import TokensPrompt
from pyxllm.entrypoints.llm import LLM
from pyxllm.sampling_params import SamplingParams


def _timed_request(
    engine, token_ids: list[int], max_tokens: int, request_id: str
) -> tuple[float, float, int]:
    """``(time to first token s, end-to-end s, output tokens)`` of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(engine.input_processor.process(request_id, TokensPrompt(token_ids), params))
    first, produced = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced = len(output.outputs[0].token_ids)
            if first is None and produced:
                first = time.perf_counter()
    return first - start, time.perf_counter() - start, produced


def bench_latency(args: argparse.Namespace, config) -> dict:
    """Run ``pyxllm bench latency``; prints and returns the figures.

    Every request, warm-ups included, gets a prompt of its own (``--dataset``'s prompts, drawn
    for ``--num-iters-warmup + --num-iters`` requests): with the prefix cache on, a repeated
    prompt would be served from the cache, and its time to first token would time no prefill.
    The result says whether the prefix cache was on and how many prompt tokens of the timed
    requests it served (``prefix_cache_hit_tokens``, 0 unless prompts share full blocks).

    Raises:
        ValueError: ``--num-iters`` below 1 or ``--num-iters-warmup`` below 0.
    """
    if args.num_iters < 1:
        raise ValueError(f"--num-iters: must be >= 1, got {args.num_iters}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup: must be >= 0, got {args.num_iters_warmup}")
    llm = LLM(**_config_kwargs(config))
    args.num_prompts = args.num_iters_warmup + args.num_iters
    prompts = [p["prompt_token_ids"] for p in _token_prompts(llm, args)]
    warmup, timed = prompts[: args.num_iters_warmup], prompts[args.num_iters_warmup :]
    engine = llm.llm_engine
    for i, ids in enumerate(warmup):
        _timed_request(engine, ids, args.output_len, f"warmup-{i}")
    hits_before = engine.stats()["prefix_cache_hits"]
    runs = [
        _timed_request(engine, ids, args.output_len, f"latency-{i}") for i, ids in enumerate(timed)
    ]
    hits = engine.stats()["prefix_cache_hits"] - hits_before
    ttft = [r[0] for r in runs]
    decode_rates = [(n - 1) / (e2e - t) for t, e2e, n in runs if n > 1 and e2e > t]
    prompt_tokens = statistics.mean(len(ids) for ids in timed)
    result = {
        "input_len": args.input_len,
        "prompt_tokens_mean": prompt_tokens,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "dtype": str(engine.executor.dtype).removeprefix("torch."),
        "quantization": engine.executor.driver.quantization,  # as resolved
        "graph_backend": engine.executor.driver.runner.name,
        "enable_prefix_cache": config.enable_prefix_cache,
        "prefix_cache_hit_tokens": hits,
        "ttft_ms_mean": statistics.mean(ttft) * 1000,
        "e2e_latency_s_mean": statistics.mean(r[1] for r in runs),
        "prefill_tokens_per_s": prompt_tokens / statistics.mean(ttft),
        "decode_tokens_per_s": statistics.mean(decode_rates) if decode_rates else None,
        "decode_ms_per_token": 1000 / statistics.mean(decode_rates) if decode_rates else None,
    }
    decode = (
        "n/a" if result["decode_tokens_per_s"] is None else f"{result['decode_tokens_per_s']:.1f}"
    )
    cache = (
        f"prefix cache on, {hits} prompt tokens of the timed requests served from it"
        if config.enable_prefix_cache
        else "prefix cache off"
    )
    print(
        f"Latency (batch 1, a fresh prompt of ~{prompt_tokens:.0f} tokens per request, "
        f"{args.output_len} new; {cache}): TTFT {result['ttft_ms_mean']:.1f} ms "
        f"(prefill {result['prefill_tokens_per_s']:.0f} tokens/s), end-to-end "
        f"{result['e2e_latency_s_mean']:.3f} s, decode {decode} tokens/s"
    )
    if args.result_file:
        write_json(args.result_file, result)
    return result
