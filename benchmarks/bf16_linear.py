"""The row-wise bfloat16 kernel (``bf16_rowwise_linear``, what ``--batch-invariant`` runs bfloat16
matmuls on) against oneDNN's bfloat16 GEMM (``F.linear``), on one thread.

SmolLM2-135M's projection shapes (K x N: 576 x 1536 gate/up, 1536 x 576 down, 576 x 576 q/o),
random bfloat16 inputs and weights, at 1 to 1000 rows. Each side is timed in short bursts, the
two sides alternating, 15 bursts each, and the best burst kept: the figures are the thread's
CPU time (``time.thread_time``), so other processes on the machine's cores slow the bursts
they share a core with, not the count. Printed per shape: GFLOP/s of each and their ratio
(above 1: the row-wise kernel is faster).

With ``--engine on`` / ``off``: the engine instead, the embedded model dequantized to bfloat16
(``--quantization none --dtype bfloat16``, one torch thread, ``--batch-invariant`` on or off, no
prefix cache): a fresh random 1000-token prompt prefilled (1 new token) and one decoded to 33
new tokens, each twice, the best kept; printed as tokens per second of the process's CPU time
(its threads' together: on a shared machine the wall clock counts other processes' turns) and
of the wall clock. Run the two settings alternating, and this file from another checkout for
its figures.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bf16_linear.py [--rows 1 8 64 256 1000]
    PYTHONPATH=. .venv/bin/python benchmarks/bf16_linear.py --engine on
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = ((576, 1536), (1536, 576), (576, 576))  # (K, N)


def best_gflops(fn, flops: int, reps: int, other, bursts: int = 15) -> tuple[float, float]:
    """GFLOP/s of ``fn`` and of ``other`` (the same ``flops`` each call): the best of
    ``bursts`` bursts of ``reps`` calls each, the two alternating, in thread CPU time."""
    best = [float("inf"), float("inf")]
    for f in (fn, other):
        f()  # warm
    for _ in range(bursts):
        for i, f in enumerate((fn, other)):
            start = time.thread_time()
            for _ in range(reps):
                f()
            best[i] = min(best[i], (time.thread_time() - start) / reps)
    return flops / best[0] / 1e9, flops / best[1] / 1e9


def engine(batch_invariant: bool) -> dict[str, float]:
    """The ``--engine`` figures (see the module docstring)."""
    import random

    from pyxllm import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(
        quantization="none",
        dtype="bfloat16",
        max_model_len=2048,
        batch_invariant=batch_invariant,
        enable_prefix_cache=False,
    )
    rng = random.Random(0)

    def seconds(new_tokens: int) -> tuple[float, float]:
        prompt = {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(1000)]}
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt], params)
        return time.perf_counter() - wall, time.process_time() - cpu

    seconds(2)  # warm-up
    prefill = [seconds(1) for _ in range(2)]
    both = [seconds(33) for _ in range(2)]
    figures = {}
    for i, clock in enumerate(("wall", "cpu")):
        p, b = min(t[i] for t in prefill), min(t[i] for t in both)
        figures[f"prefill tok/s ({clock})"] = round(1000 / p, 1)
        figures[f"decode tok/s ({clock})"] = round(32 / (b - p), 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 1000])
    parser.add_argument("--engine", choices=("on", "off"), help="--batch-invariant on or off")
    args = parser.parse_args()
    if args.engine:
        print(f"--batch-invariant {args.engine}:", engine(args.engine == "on"))
        return
    from pyxllm.kernels.cpu import fused

    if fused.load() is None:
        raise SystemExit("the fused CPU kernels are not built (PYXLLM_CPU_KERNELS=native?)")
    torch.set_num_threads(1)
    print(f"bf16_rowwise_linear's branch: {fused.bf16_linear_path()}; one thread")
    print(f"{'rows':>5} {'K':>5} {'N':>5} {'oneDNN GF/s':>12} {'row-wise GF/s':>14} {'ratio':>6}")
    kernel = torch.ops.pyxllm_cpu.bf16_rowwise_linear.default
    for rows in args.rows:
        for k, n in SHAPES:
            x = torch.randn(rows, k).bfloat16()
            w = torch.randn(n, k).bfloat16()
            flops = 2 * rows * k * n
            ours, onednn = best_gflops(
                lambda: kernel(x, w, None),  # noqa: B023 - called before the loop moves on
                flops,
                max(2, int(6e7 // flops)),
                lambda: F.linear(x, w),  # noqa: B023
            )
            print(f"{rows:5d} {k:5d} {n:5d} {onednn:12.1f} {ours:14.1f} {ours / onednn:6.2f}")


if __name__ == "__main__":
    main()
