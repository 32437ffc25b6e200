"""The CPU matmul kernels' arithmetic rate at 1 to 512 rows, in one run: where a load is bound
by compute rather than by bytes.

For one weight shape (default 8192 x 2048, Llama-3.2-1B's MLP up projection) and each row
count, the best of 3 timings of:

- ``int4``: ``int4_linear`` with ``batch_invariant`` (the default path of a GGUF's Q4_0 / Q4_1 /
  Q4_K weights: activations in two int8 parts, so two integer dot products per weight and row);
- ``w8a8``: ``w8a8_linear`` (``--quantization w8a8``: one int8 part, oneDNN's integer GEMM);
- ``bf16-rowwise``: the row-invariant bfloat16 kernel (a float checkpoint in bfloat16, the
  default);
- ``bf16-onednn``: ``F.linear`` in bfloat16 (``--no-batch-invariant``'s matmul).

It prints GMAC/s (1e9 multiply-adds of a weight and an activation per second) per kernel and
row count. Random values: the rate depends on the shapes only. Run from the repository root::

    .venv/bin/python benchmarks/matmul_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pyxllm.kernels.cpu import fused


def best_seconds(fn, rows: int, repeats: int = 3) -> float:
    """The best of ``repeats`` timings of ``fn`` (seconds a call), each over enough calls to
    pass 64 rows."""
    fn()
    calls = max(1, 64 // rows)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def kernels(n: int, k: int) -> dict:
    """``{name: fn(x)}`` over random weights ``[n, k]`` in each kernel's layout."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(k // 32, n, generator=gen) * 0.01 + 0.001).half().float()
    packed, pairs = fused.pack_int4_weight(q, torch.stack((scales, torch.zeros_like(scales)), -1))
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    weight_scales = torch.rand(n, generator=gen)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    return {
        "int4": lambda x: fused.int4_linear(x, packed, pairs, 32, None, True),
        "w8a8": lambda x: fused.w8a8_linear(x, qweight, weight_scales),
        "bf16-rowwise": lambda x: fused.linear(x, weight, None, True),
        "bf16-onednn": lambda x: F.linear(x, weight),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--rows", default="1,8,32,128,512", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fused.load()
    n, k = args.out_features, args.in_features
    table = kernels(n, k)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{n} x {k} weights, {args.threads} thread(s), GMAC/s")
    print(f"{'rows':>6}" + "".join(f"{name:>14}" for name in table))
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        rates = [
            m * n * k / best_seconds(lambda fn=fn, x=x: fn(x), m) / 1e9 for fn in table.values()
        ]
        print(f"{m:>6}" + "".join(f"{r:>14.1f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
