"""``pyxllm bench throughput``: offline throughput of the ``LLM`` API.

``--num-prompts`` prompts of ``--input-len`` tokens, each generating exactly
``--output-len`` tokens (greedy, ``ignore_eos``), submitted at once to one ``LLM``; after one
untimed warm-up request, reports requests/s, output tokens/s and total tokens/s. The flags
and helpers here are shared with ``bench latency`` (``pyxllm.benchmarks.latency``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pyxllm.benchmarks.prompts import DATASETS, make_prompts
from pyxllm.benchmarks.report import write_json
from pyxllm.sampling_params import SamplingParams


def add_offline_args(parser: argparse.ArgumentParser, kind: str) -> None:
    """The benchmark flags of ``bench throughput`` (``kind="throughput"``) or ``bench latency``."""
    throughput = kind == "throughput"
    parser.add_argument(
        "--dataset", choices=DATASETS, default="random", help="random or fixed prompt texts"
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=64 if throughput else 1,
        help="requests" if throughput else argparse.SUPPRESS,
    )
    parser.add_argument(
        "--input-len", type=int, default=100 if throughput else 32, help="prompt length in tokens"
    )
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    if not throughput:
        parser.add_argument("--num-iters", type=int, default=3, help="timed requests")
        parser.add_argument(
            "--num-iters-warmup", type=int, default=1, help="untimed requests first"
        )
    parser.add_argument(
        "--result-file", default=None, metavar="PATH", help="write the results as JSON here"
    )


def _token_prompts(llm, args) -> list[dict]:
    prompts = make_prompts(
        llm.get_tokenizer().hf, args.num_prompts, args.input_len, args.dataset, args.seed
    )
    return [{"prompt_token_ids": ids} for _, ids in prompts]


def bench_throughput(args: argparse.Namespace, config) -> dict:
    """Run ``pyxllm bench throughput``; prints and returns the figures."""
    # here, not at the top: `pyxllm bench --help` loads this module, and LLM loads torch
    from pyxllm.entrypoints.llm import LLM

    llm = LLM(**{k: v for k, v in _config_kwargs(config).items()})
    prompts = _token_prompts(llm, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(llm.llm_engine.executor.dtype).removeprefix("torch."),
        "quantization": llm.llm_engine.executor.driver.quantization,  # as resolved
        "graph_backend": llm.llm_engine.executor.driver.runner.name,
        "elapsed_s": elapsed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output "
        f"tokens/s, {result['total_tokens_per_s']:.1f} total tokens/s ({len(prompts)} requests, "
        f"{input_tokens} + {output_tokens} tokens in {elapsed:.2f} s)"
    )
    if args.result_file:
        write_json(args.result_file, result)
    return result


def _config_kwargs(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
