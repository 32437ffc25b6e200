"""Time to first token and time per output token of prefill/decode disaggregation against one
colocated server, in one run.

Two set-ups serve the same ``--num-prompts`` random prompts of ``--prompt-tokens`` tokens,
``--clients`` at a time, each answer ``--output-tokens`` tokens (streamed, ``ignore_eos``), with
``pyxllm bench serve``'s client (:func:`pyxllm.benchmarks.serve.run_benchmark`):

- ``colocated``: one ``pyxllm serve`` computing with ``--threads`` threads;
- ``disaggregated``: a prefill instance and a decode instance (``--kv-role prefill|decode``)
  on one temporary ``--kv-offload-dir``, each with half the threads, behind ``pyxllm
  disagg-proxy``.

Printed: each set-up's TTFT and TPOT (mean and median, ms), and the disaggregated/colocated
ratios. Both set-ups share this host's cores, so the disaggregated one has no more compute than
the colocated one: what it changes is that decodes no longer wait behind other requests'
prefills (docs/serving.md, Prefill/decode disaggregation, says when that pays). Run from the
repository root::

    .venv/bin/python benchmarks/disagg.py --clients 8 --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import httpx

from pyxllm.benchmarks.metrics import compute_metrics
from pyxllm.benchmarks.prompts import load_tokenizer, make_prompts
from pyxllm.benchmarks.serve import run_benchmark


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def started(command: list[str], threads: int | None = None, timeout: float = 300.0):
    """``python -m pyxllm COMMAND --port P`` running until the block ends; yields its root
    URL once ``/health`` answers 200.

    Raises:
        RuntimeError: it exited or was not healthy within ``timeout`` seconds.
    """
    port = free_port()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    args = [sys.executable, "-m", "pyxllm", *command, "--port", str(port)]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{command[0]} did not start:\n{log.read().decode()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(url: str, prompts, warmup, args) -> dict:
    """One load run against ``url`` after a request of ``warmup`` (the first request of a
    server also chooses its thread counts): the bench metrics, as a dict."""
    asyncio.run(run_benchmark(url + "/v1", warmup, 4, 1))
    records, duration = asyncio.run(
        run_benchmark(url + "/v1", prompts, args.output_tokens, args.clients)
    )
    metrics = compute_metrics(records, duration)
    if metrics.failed:
        errors = {r.error for r in records if not r.success}
        raise RuntimeError(f"{metrics.failed} requests failed: {errors}")
    return metrics.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    warmup = make_prompts(tokenizer, 1, 128, seed=1)
    serve = ["serve", *([args.model] if args.model else []), "--disable-log-stats"]
    serve += ["--max-model-len", str(args.prompt_tokens + args.output_tokens + 64)]
    half = max(1, args.threads // 2)
    results = {}
    with started(serve, args.threads) as url:
        results["colocated"] = measure(url, prompts, warmup, args)
    with tempfile.TemporaryDirectory() as shared, ExitStack() as stack:
        tier = [*serve, "--kv-offload-dir", shared, "--kv-role"]
        prefill = stack.enter_context(started([*tier, "prefill"], half))
        decode = stack.enter_context(started([*tier, "decode"], half))
        proxy = ["disagg-proxy", "--prefill", prefill, "--decode", decode]
        proxy_url = stack.enter_context(started(proxy))
        results["disaggregated"] = measure(proxy_url, prompts, warmup, args)
    print(
        f"{args.num_prompts} prompts of {args.prompt_tokens} tokens, {args.clients} clients, "
        f"{args.output_tokens} tokens each; colocated {args.threads} threads, disaggregated "
        f"{half} + {half}"
    )
    for name, m in results.items():
        print(
            f"{name:>13}: TTFT mean {m['ttft_ms']['mean']:.0f} ms, median "
            f"{m['ttft_ms']['median']:.0f} ms; TPOT mean {m['tpot_ms']['mean']:.1f} ms, median "
            f"{m['tpot_ms']['median']:.1f} ms; {m['duration_s']:.1f} s"
        )
    co, dis = results["colocated"], results["disaggregated"]
    print(
        "disaggregated / colocated: "
        + ", ".join(
            f"{key[:-3].upper()} {stat} {dis[key][stat] / co[key][stat]:.2f}x"
            for key in ("ttft_ms", "tpot_ms")
            for stat in ("mean", "median")
        )
    )


if __name__ == "__main__":
    main()
