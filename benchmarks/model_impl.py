"""``--model-impl transformers`` against pyxllm's native model code and transformers' own
``generate``, on the default model and the same prompts, in one run.

Offline throughput (``LLM.generate``, greedy, exactly ``--output-len`` new tokens per prompt) of
pyxllm with its native Llama and with transformers' ``LlamaForCausalLM`` on pyxllm's paged
attention (both ``--dtype auto``, the eager runner, float weights), and of transformers
``generate`` in bfloat16 in batches of ``--hf-batch-size`` (16) left-padded prompts; and the
batch-1 decode rate of both pyxllm implementations. Prints each figure and the ratios. Run from
the repository root::

    .venv/bin/python benchmarks/model_impl.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/model_impl.py --num-prompts 32 --result-file impl.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from compare import hf_throughput
from harness import log, ratio_lines

from pyxllm.benchmarks.prompts import load_tokenizer, make_prompts
from pyxllm.weights.source import default_gguf_path


def pyxllm_throughput(prompts: list[list[int]], output_len: int, model_impl: str) -> dict:
    """Output tokens/s of one ``LLM.generate`` over every prompt, after a warm-up request, and
    the decode rate of one request alone (batch 1, tokens after the first per second)."""
    from pyxllm import LLM, SamplingParams
    from pyxllm.benchmarks.latency import _timed_request

    llm = LLM(
        model_impl=model_impl,
        quantization="none",  # float weights and the eager runner for both, as said above
        graph_backend="eager",
        max_model_len=1024,
        kv_cache_memory=1.0,
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], warm)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft, e2e, n = _timed_request(llm.llm_engine, prompts[-1][::-1], output_len, "batch-1")
    return {
        "output_tok_s": produced / elapsed,
        "batch1_decode_tok_s": (n - 1) / (e2e - ttft),
        "elapsed_s": elapsed,
        "dtype": str(llm.llm_engine.executor.dtype).removeprefix("torch."),
        "model": type(llm.llm_engine.executor.driver.model).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(load_tokenizer(None), args.num_prompts, args.input_len, "random", 0)
    ids = [p[1] for p in prompts]
    log(
        f"{len(ids)} prompts of ~{args.input_len} tokens, {args.output_len} new tokens each, "
        f"{args.threads} threads"
    )
    results = {}
    for impl in ("pyxllm", "transformers"):
        results[impl] = pyxllm_throughput(ids, args.output_len, impl)
        log(f"pyxllm --model-impl {impl}:", json.dumps(results[impl]))
        gc.collect()
    results["transformers generate"] = hf_throughput(
        default_gguf_path(), ids, args.output_len, args.hf_batch_size
    )
    log("transformers generate:", json.dumps(results["transformers generate"]))
    native, through = results["pyxllm"]["output_tok_s"], results["transformers"]["output_tok_s"]
    hf = results["transformers generate"]["output_tok_s"]
    lines = ["", "=== output tok/s (ratios > 1: the first is faster) ==="]
    lines += ratio_lines(
        "--model-impl pyxllm", native, {"--model-impl transformers": through}, "tok/s"
    )
    lines += ratio_lines(
        "batch 1 decode, --model-impl pyxllm",
        results["pyxllm"]["batch1_decode_tok_s"],
        {"--model-impl transformers": results["transformers"]["batch1_decode_tok_s"]},
        "tok/s",
    )
    lines += ratio_lines(
        "--model-impl transformers",
        through,
        {f"transformers generate bf16 batch {args.hf_batch_size}": hf},
        "tok/s",
    )
    log("\n".join(lines))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
