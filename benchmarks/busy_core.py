"""Batch-1 decode on a quiet machine and with one core kept busy by another process, pyxllm
against llama-bench, in one run.

The busy process is started here (``python3 -c 'while True: pass'``, one core's worth) and
stopped after each busy measurement. Rows:

- pyxllm with no flags (the defaults: the GGUF's weights as stored, the graph runner, the
  thread count chosen per step by measuring, see ``pyxllm/executor/thread_tuner.py``);
- the same with ``PYXLLM_ADAPTIVE_THREADS=0`` (every step on all threads): what the tuner
  changes;
- llama-bench ``tg`` on the same GGUF with as many threads, where
  ``benchmarks/build_llama_server.sh`` built it (``--llama-bin-dir``), else skipped.

The engines take turns: in each of ``--rounds`` rounds, every row runs quiet, then every row
runs with the core busy, so a ratio compares runs a minute apart at most (a shared host's speed
moved by ~20 % within minutes on the development machines). Each row prints its quiet and busy
decode tok/s (the median over the rounds) and busy / quiet; the last lines print pyxllm's ratios
to llama-bench, quiet and busy, as the median of the rounds' ratios (each round's in brackets).
Run from the repository root::

    benchmarks/build_llama_server.sh    # once, for the llama-bench row
    .venv/bin/python benchmarks/busy_core.py
    .venv/bin/python benchmarks/busy_core.py --rounds 3 --output-len 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pyxllm.weights.source import default_gguf_path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """While inside: one process spinning on a core (nothing when ``busy`` is false)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def pyxllm_decode(
    model: str, output_len: int, iters: int, threads: int, env: dict, flags: tuple = ()
) -> float:
    """``pyxllm bench latency``'s decode tok/s (a 32-token prompt, ``output_len`` new tokens),
    with the environment ``env`` and the engine ``flags`` added."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "latency.json"
        cmd = [
            str(ROOT / ".venv" / "bin" / "pyxllm"),
            "bench",
            "latency",
            "--model",
            model,
            "--input-len",
            "32",
            "--output-len",
            str(output_len),
            "--num-iters",
            str(iters),
            "--num-iters-warmup",
            "1",
            "--result-file",
            str(result),
            *flags,
        ]
        run_env = {**os.environ, "OMP_NUM_THREADS": str(threads), **env}
        subprocess.run(cmd, check=True, env=run_env, capture_output=True, text=True)
        return float(json.loads(result.read_text())["decode_tokens_per_s"])


def llama_bench_decode(binary: Path, model: str, output_len: int, iters: int, threads: int):
    """llama-bench's ``tg{output_len}`` tok/s (mean over ``iters`` repetitions)."""
    done = subprocess.run(
        [str(binary), "-m", model, "-p", "0", "-n", str(output_len), "-t", str(threads),
         "-r", str(iters), "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(done.stdout)
    return float(rows[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_gguf_path()), help="a .gguf file")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--llama-bin-dir",
        default=None,
        help="where build_llama_server.sh put llama-bench (default: its cache directory)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of every row, quiet then busy (see above)"
    )
    args = parser.parse_args()
    env_of = {
        "pyxllm (defaults)": {},
        "pyxllm (PYXLLM_ADAPTIVE_THREADS=0)": {"PYXLLM_ADAPTIVE_THREADS": "0"},
    }
    binary = find_llama_bench(args.llama_bin_dir)
    if binary is None:
        print("llama-bench not built (benchmarks/build_llama_server.sh): skipped")
    names = [*env_of, *(["llama-bench"] if binary is not None else [])]
    # name -> state -> one figure per round
    runs: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "busy": []} for n in names}
    for _ in range(args.rounds):
        for state in ("quiet", "busy"):
            with busy_core(state == "busy"):
                for name in names:
                    if name == "llama-bench":
                        rate = llama_bench_decode(
                            binary, args.model, args.output_len, args.iters, args.threads
                        )
                    else:
                        rate = pyxllm_decode(
                            args.model, args.output_len, args.iters, args.threads, env_of[name]
                        )
                    runs[name][state].append(rate)
                    print(name, state, f"{rate:.1f} tok/s", flush=True)
    print(
        f"\nbatch-1 decode, {args.threads} threads, {args.output_len} new tokens, "
        f"{args.rounds} round(s), {args.model}"
    )
    print(f"{'':38} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>11}")
    for name, row in runs.items():
        quiet, busy = statistics.median(row["quiet"]), statistics.median(row["busy"])
        print(f"{name:38} {quiet:12.1f} {busy:11.1f} {busy / quiet:10.0%}")
    if "llama-bench" in runs:
        ours, peer = runs["pyxllm (defaults)"], runs["llama-bench"]
        for state in ("quiet", "busy"):
            ratios = [a / b for a, b in zip(ours[state], peer[state])]
            each = ", ".join(f"{r:.2f}x" for r in ratios)
            print(
                f"pyxllm defaults / llama-bench, {state}: {statistics.median(ratios):.2f}x "
                f"(rounds: {each})"
            )


def find_llama_bench(bin_dir: str | None) -> Path | None:
    """``llama-bench`` in ``bin_dir``, else in build_llama_server.sh's default cache directory
    (the newest version there), or None."""
    if bin_dir is not None:
        path = Path(bin_dir) / "llama-bench"
        return path if path.is_file() else None
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyxllm"
    found = sorted(
        cache.glob("llama.cpp-*/bin/llama-bench"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)],
    )
    return found[-1] if found else None


if __name__ == "__main__":
    main()
