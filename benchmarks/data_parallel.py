"""Data parallelism on one host, in one run: replicas against one engine, and cache-aware
routing against round robin.

Every server is a ``pyxllm serve`` on the default model with ``--threads`` OpenMP threads in all
(default: every core), driven by ``pyxllm bench serve``'s client (streamed completions, greedy,
``ignore_eos``), ``--concurrency`` (32) clients, after an untimed warm-up request on each
replica:

1. Scaling: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` new
   tokens each, on ``--data-parallel-size 1`` (one engine on every core) and on
   ``--data-parallel-size 2`` (two replicas, half the cores each). Output tok/s, median TTFT
   and TPOT.
2. Routing, on a shared-prefix load: ``--groups`` system prompts of ``--prefix-len`` tokens,
   each followed by a short question of its own, the groups in a random order, on
   ``--data-parallel-size 2`` with ``--dp-routing cache_aware`` and with ``round_robin`` (a
   fresh server each, so both start cold). The prefix-cache hit rate (the replicas' hits over
   their queries, in tokens, from ``/metrics``), median TTFT and output tok/s.

Run from the repository root (the real figures: a quiet machine, ~2 min on 2 cores)::

    .venv/bin/python benchmarks/data_parallel.py --result-file data_parallel.json
    .venv/bin/python benchmarks/data_parallel.py --num-prompts 8 --output-len 4 \\
        --concurrency 4 --groups 2 --prefix-len 64            # a smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random

import httpx
from harness import log, pyxllm_serve_cmd, start_server
from prometheus_client.parser import text_string_to_metric_families

from pyxllm.benchmarks.metrics import compute_metrics
from pyxllm.benchmarks.prompts import PASSAGE, load_tokenizer, make_prompts
from pyxllm.benchmarks.serve import run_benchmark

PORT = 18951
QUESTIONS = (
    "What is the first thing it says?",
    "Summarize it in one line.",
    "Which century does it mention?",
    "Name one tool it describes.",
)


def shared_prefix_prompts(
    tokenizer, groups: int, prefix_len: int, num_prompts: int
) -> list[tuple[str, list[int]]]:
    """``num_prompts`` prompts over ``groups`` system prompts of about ``prefix_len`` tokens
    (each opens with its own number, so no two share a first KV block), as many of each, each
    followed by a question of its own, in a seeded random order (cycling through the groups
    in order would hand round robin a group per replica)."""
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    body = passage * (prefix_len // len(passage) + 2)
    prefixes = []
    for g in range(groups):
        head = tokenizer.encode(f"Reference text {g}. ", add_special_tokens=False)
        prefixes.append(tokenizer.decode((head + body)[:prefix_len]))
    prompts = []
    for i in range(num_prompts):
        text = f"{prefixes[i % groups]}\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}"
        prompts.append((text, tokenizer.encode(text, add_special_tokens=False)))
    random.Random(0).shuffle(prompts)
    return prompts


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """``(hits, queries)`` of the server's prefix cache in tokens, over every replica."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and "replica" not in sample.labels:
                totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


def serve_and_measure(args, flags: list[str], prompts, replicas: int) -> dict:
    """Start a server with ``flags`` (``replicas`` of them), warm each replica up, run
    ``prompts`` through it; its figures."""
    cmd = pyxllm_serve_cmd(
        PORT,
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--disable-log-stats",
        *flags,
    )
    root, base = f"http://127.0.0.1:{PORT}", f"http://127.0.0.1:{PORT}/v1"
    proc = start_server("pyxllm serve", cmd, PORT, args.threads)
    try:
        # as many at once as replicas: every routing policy sends one to each
        warm_up = [(f"Warm-up prompt {i}.", []) for i in range(replicas)]
        asyncio.run(run_benchmark(base, warm_up, 4, replicas))
        hits0, queries0 = prefix_cache_totals(root)
        records, duration = asyncio.run(
            run_benchmark(base, prompts, args.output_len, args.concurrency)
        )
        hits1, queries1 = prefix_cache_totals(root)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    m = compute_metrics(records, duration)
    if m.failed:
        errors = sorted({r.error for r in records if not r.success})
        raise RuntimeError(f"{m.failed} requests failed with {flags}: {errors[:3]}")
    queries = queries1 - queries0
    return {
        "flags": flags,
        "output_tok_s": m.output_throughput,
        "median_ttft_ms": m.ttft_ms["median"],
        "median_tpot_ms": m.tpot_ms["median"],
        "prefix_hit_rate": (hits1 - hits0) / queries if queries else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--kv-cache-memory", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    tokenizer = load_tokenizer(None)
    random_prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, "random", 0)
    shared = shared_prefix_prompts(tokenizer, args.groups, args.prefix_len, args.num_prompts)
    runs = {
        "dp1": serve_and_measure(args, ["--data-parallel-size", "1"], random_prompts, 1),
        "dp2": serve_and_measure(args, ["--data-parallel-size", "2"], random_prompts, 2),
    }
    for policy in ("cache_aware", "round_robin"):
        flags = ["--data-parallel-size", "2", "--dp-routing", policy]
        runs[policy] = serve_and_measure(args, flags, shared, 2)

    log(
        f"{args.concurrency} clients, {args.threads} threads in all; scaling: "
        f"{args.num_prompts} random prompts of {args.input_len} tokens, {args.output_len} new "
        f"tokens each"
    )
    for name, label in (("dp1", "DP=1, one engine"), ("dp2", "DP=2, two replicas")):
        run = runs[name]
        log(
            f"  {label:<20} {run['output_tok_s']:7.1f} output tok/s, median TTFT "
            f"{run['median_ttft_ms']:6.0f} ms, median TPOT {run['median_tpot_ms']:5.1f} ms"
        )
    ratio = runs["dp2"]["output_tok_s"] / runs["dp1"]["output_tok_s"]
    log(f"  DP=2 / DP=1 output tok/s: {ratio:.2f}x")
    log(
        f"routing, DP=2: {args.groups} system prompts of {args.prefix_len} tokens, "
        f"{args.num_prompts} requests"
    )
    for policy in ("cache_aware", "round_robin"):
        run = runs[policy]
        log(
            f"  {policy:<12} prefix hit rate {100 * run['prefix_hit_rate']:5.1f} %, median TTFT "
            f"{run['median_ttft_ms']:6.0f} ms, {run['output_tok_s']:7.1f} output tok/s"
        )
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)
        log(f"results: {args.result_file}")


if __name__ == "__main__":
    main()
