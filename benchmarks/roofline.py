"""Batch-1 decode against this machine's memory roofline, in one run.

A batch-1 decode step reads every weight once (the embedding table excepted: one row of it),
plus the KV cache of its context; with nothing else to do it would take those bytes divided by
the memory bandwidth. This script measures:

1. the read bandwidth: ``torch.sum`` over a 1 GiB float32 tensor with ``--threads`` threads,
   the best of 5 (GB/s, 1e9 bytes);
2. the bytes a decode step reads: the ``nbytes`` of every parameter and buffer of the loaded
   model but the input embedding table, plus the KV rows of a context of ``--context`` tokens;
3. the decode time per token: ``LLM.generate`` of ``--output-len`` tokens from a short prompt,
   greedy, EOS ignored, the best of 3 runs, the prompt's prefill taken off (one
   ``max_tokens=1`` run of the same prompt with the prefix cache off).

It prints the roofline time (bytes / bandwidth), the measured time and their ratio: the share
of the roofline reached. Run from the repository root::

    .venv/bin/python benchmarks/roofline.py --quantization int4 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from pyxllm import LLM, SamplingParams
from pyxllm.layers.quantization import UNQUANTIZED
from pyxllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

PROMPT = "The history of the river valley begins"


def read_bandwidth(repeats: int = 5, gib: float = 1.0) -> float:
    """Read bandwidth in GB/s: ``torch.sum`` over ``gib`` GiB of float32, best of ``repeats``."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    data.sum()  # first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def bytes_per_token(llm: LLM, context: int) -> int:
    """Bytes one batch-1 decode step reads: the model's tensors but the input embedding table,
    and ``context`` tokens of KV rows in every layer."""
    executor = llm.llm_engine.executor.driver
    model = executor.model
    tables = {m.weight.data_ptr() for m in model.modules() if type(m) is VocabParallelEmbedding}
    head = {  # a tied, unquantized head reads the whole table (a quantized one its own copy)
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, ParallelLMHead) and m.quant_method is UNQUANTIZED
    }
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.nbytes for ptr, t in tensors.items() if ptr not in tables - head)
    k_cache = executor.kv_caches[0][0]
    block_size = llm.llm_engine.config.block_size
    row_bytes = k_cache[0].nbytes // block_size  # one token's K of one layer
    return total + 2 * len(executor.kv_caches) * context * row_bytes


def decode_ms_per_token(llm: LLM, output_len: int) -> float:
    """Milliseconds per decoded token at batch 1 (best of 3, the prompt's prefill taken off)."""

    def timed(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(8)  # warm-up
    prefill = min(timed(1) for _ in range(3))
    return min((timed(output_len) - prefill) / (output_len - 1) for _ in range(3)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", help="none, int8, int4, w8a8")
    parser.add_argument("--graph-backend", default="graph")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--context", type=int, default=64, help="tokens of KV read per step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    llm = LLM(
        quantization=None if args.quantization == "none" else args.quantization,
        graph_backend=args.graph_backend,
        enable_prefix_caching=False,
    )
    step_bytes = bytes_per_token(llm, args.context)
    measured = decode_ms_per_token(llm, args.output_len)
    roofline = step_bytes / bandwidth / 1e6
    print(
        f"read bandwidth {bandwidth:.1f} GB/s ({torch.get_num_threads()} threads); "
        f"a decode step reads {step_bytes / 1e6:.1f} MB ({args.quantization}, "
        f"{args.context} tokens of context): roofline {roofline:.2f} ms a token; measured "
        f"{measured:.2f} ms ({1e3 / measured:.1f} tok/s) = {roofline / measured:.0%} of it"
    )


if __name__ == "__main__":
    main()
