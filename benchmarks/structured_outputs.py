"""What structured outputs cost a server, in one run: the same load with and without a JSON
schema on every request.

One ``pyxllm serve`` (the default model, ``--structured-outputs-backend`` as given) and
``pyxllm bench serve``'s client: ``--concurrency`` (8) clients, ``--num-prompts`` prompts of
``--input-len`` tokens, exactly ``--output-len`` new tokens each (``ignore_eos``: after the JSON
is complete the grammar allows only EOS, so both runs generate as many tokens). The two loads
alternate twice (unconstrained, constrained, unconstrained, constrained) and the second of each
counts, so neither pays the server's warm-up. Printed: output tok/s of each and their ratio
(target: at least 0.9x); the first request's TTFT in the first constrained load (the schema
compiles there) and in the second (the compiled schema is reused); and the schema's compile
time measured alone. Run from the repository root::

    .venv/bin/python benchmarks/structured_outputs.py            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from harness import log, pyxllm_serve_cmd, start_server

from pyxllm.benchmarks.metrics import compute_metrics
from pyxllm.benchmarks.prompts import load_tokenizer, make_prompts
from pyxllm.benchmarks.serve import BENCH_SCHEMA, run_benchmark, structured_output_fields

PORT = 18941


def compile_time(backend: str) -> float:
    """Seconds to compile BENCH_SCHEMA once the backend is ready (its vocabulary built)."""
    from pyxllm.engine.structured_output import StructuredOutputManager
    from pyxllm.sampling_params import StructuredOutputsParams
    from pyxllm.weights import load_hf_tokenizer, resolve_model_source

    hf = load_hf_tokenizer(resolve_model_source(None))
    manager = StructuredOutputManager(backend, hf, len(hf), [hf.eos_token_id])
    manager.submit(StructuredOutputsParams(regex="warm-up")).compiled()
    start = time.perf_counter()
    manager.submit(StructuredOutputsParams(json=BENCH_SCHEMA)).compiled()
    seconds = time.perf_counter() - start
    manager.shutdown()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--backend", default="llguidance", choices=("llguidance", "xgrammar"))
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    prompts = make_prompts(load_tokenizer(None), args.num_prompts, args.input_len, "random", 0)
    cmd = pyxllm_serve_cmd(
        PORT,
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "0.5",
        "--structured-outputs-backend",
        args.backend,
    )
    proc = start_server("pyxllm serve", cmd, PORT, args.threads)
    url, results = f"http://127.0.0.1:{PORT}/v1", {}
    try:
        for kind in ("none", "json", "none", "json"):
            records, duration = asyncio.run(
                run_benchmark(
                    url,
                    prompts,
                    args.output_len,
                    args.concurrency,
                    extra_fields=structured_output_fields(kind),
                )
            )
            m = compute_metrics(records, duration)
            if m.failed:
                errors = sorted({r.error for r in records if not r.success})
                raise RuntimeError(f"{m.failed} {kind} requests failed: {errors[:3]}")
            first_ttft = 1000 * (records[0].ttft or float("nan"))
            results.setdefault(f"{kind}_first_ttft_ms", first_ttft)  # the first load's
            results[kind] = {
                "output_tok_s": m.output_throughput,
                "failed": m.failed,
                "median_ttft_ms": m.ttft_ms["median"],
                "first_ttft_ms": first_ttft,
            }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results["compile_s"] = compile_time(args.backend)
    free, constrained = results["none"], results["json"]
    log(
        f"backend {args.backend}, {args.concurrency} clients, {args.num_prompts} prompts of "
        f"{args.input_len} tokens, {args.output_len} new tokens each"
    )
    log(
        f"  unconstrained: {free['output_tok_s']:.1f} output tok/s, median TTFT "
        f"{free['median_ttft_ms']:.0f} ms"
    )
    log(
        f"  json schema:   {constrained['output_tok_s']:.1f} output tok/s, median TTFT "
        f"{constrained['median_ttft_ms']:.0f} ms"
    )
    log(
        f"  first request's TTFT: {results['json_first_ttft_ms']:.0f} ms in the first constrained "
        f"load (compiling), {constrained['first_ttft_ms']:.0f} ms in the second (cached); "
        f"unconstrained {free['first_ttft_ms']:.0f} ms"
    )
    log(
        f"  ratio constrained/unconstrained: "
        f"{constrained['output_tok_s'] / free['output_tok_s']:.2f}x (target >= 0.9x)"
    )
    log(
        f"  compiling the schema alone: {1000 * results['compile_s']:.1f} ms (a repeated schema: "
        "0, a cache hit)"
    )
    if constrained["failed"] or free["failed"]:
        log(f"  failed requests: {free['failed']} unconstrained, {constrained['failed']} json")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
