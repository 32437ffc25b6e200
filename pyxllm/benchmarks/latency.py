"""``pyxllm bench latency``: one request at a time (batch 1).

Runs ``--num-iters`` requests (after ``--num-iters-warmup``), driving the engine step by step:
the time to the first token (the prefill of ``--input-len`` tokens) and the decode rate of the
remaining ``--output-len - 1`` tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pyxllm.benchmarks.report import write_json
from pyxllm.benchmarks.throughput import _config_kwargs, _token_prompts


def _timed_request(
    engine, token_ids: list[int], max_tokens: int, request_id: str
) -> tuple[float, float, int]:
    """``(time to first token s, end-to-end s, output tokens)`` of one request run alone."""
    from pyxllm.engine.input_processor import TokensPrompt
    from pyxllm.sampling_params import SamplingParams

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
    """Run ``pyxllm bench latency``; prints and returns the figures."""
    from pyxllm.entrypoints.llm import LLM

    llm = LLM(**_config_kwargs(config))
    args.num_prompts = 1
    ids = _token_prompts(llm, args)[0]["prompt_token_ids"]
    engine = llm.llm_engine
    for i in range(args.num_iters_warmup):
        _timed_request(engine, ids, args.output_len, f"warmup-{i}")
    runs = [
        _timed_request(engine, ids, args.output_len, f"latency-{i}") for i in range(args.num_iters)
    ]
    ttft = [r[0] for r in runs]
    decode_rates = [(n - 1) / (e2e - t) for t, e2e, n in runs if n > 1 and e2e > t]
    result = {
        "input_len": len(ids),
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "dtype": str(engine.executor.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "graph_backend": config.graph_backend,
        "ttft_ms_mean": statistics.mean(ttft) * 1000,
        "e2e_latency_s_mean": statistics.mean(r[1] for r in runs),
        "prefill_tokens_per_s": len(ids) / statistics.mean(ttft),
        "decode_tokens_per_s": statistics.mean(decode_rates) if decode_rates else None,
        "decode_ms_per_token": 1000 / statistics.mean(decode_rates) if decode_rates else None,
    }
    decode = (
        "n/a" if result["decode_tokens_per_s"] is None else f"{result['decode_tokens_per_s']:.1f}"
    )
    print(
        f"Latency (batch 1, {len(ids)} prompt tokens, {args.output_len} new): TTFT "
        f"{result['ttft_ms_mean']:.1f} ms, end-to-end {result['e2e_latency_s_mean']:.3f} s, "
        f"decode {decode} tokens/s"
    )
    if args.result_file:
        write_json(args.result_file, result)
    return result
