"""Time to first token and time per output token of prefill/decode disaggregation against one
colocated server, in one run.

The set-ups serve the same random prompts of ``--prompt-tokens`` tokens, each answer
``--output-tokens`` tokens (streamed, ``ignore_eos``), with ``pyxllm bench serve``'s client
(:func:`pyxllm.benchmarks.serve.run_benchmark`), at each of ``--clients`` (``--num-prompts``
prompts, default as many as clients, new ones at each level so that no prefix cache helps):

- ``colocated``: one ``pyxllm serve`` computing with ``--threads`` threads;
- ``disaggregated`` (``--transfer directory``, the default): a prefill instance and a decode
  instance (``--kv-role prefill|decode``) on one temporary ``--kv-offload-dir``, each with
  half the threads, behind ``pyxllm disagg-proxy``;
- ``disaggregated over TCP`` (``--transfer tcp``): the same, each instance on a directory of
  its own, the prefill instance pushing KV to the decode instance's ``--kv-transfer-listen``
  on localhost (with a shared secret), the proxy naming it (``--decode-kv-listen``).

All set-ups run at once, idle but for the one measured; at each level they are measured in
turn, so load from other processes falls on all alike. Printed: each set-up's TTFT and TPOT
(mean and median, ms) and its ratios to colocated. The set-ups share this host's cores, so the
disaggregated ones have no more compute than the colocated one: what they change is that
decodes no longer wait behind other requests' prefills (docs/serving.md, Prefill/decode
disaggregation, says when that pays). Run from the repository root::

    .venv/bin/python benchmarks/disagg.py --clients 8 --prompt-tokens 1024
    .venv/bin/python benchmarks/disagg.py --clients 8 32 --transfer tcp --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
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
def started(
    command: list[str], threads: int | None = None, timeout: float = 300.0, env: dict | None = None
):
    """``python -m pyxllm COMMAND --port P`` running until the block ends (``env``: more
    environment variables); yields its root URL once ``/health`` answers 200.

    Raises:
        RuntimeError: it exited or was not healthy within ``timeout`` seconds.
    """
    port = free_port()
    env = dict(os.environ, **(env or {}), **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
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


def kv_counters(prefill_url: str, decode_url: str) -> dict[str, float]:
    """What moved between a prefill and a decode instance, from their ``/metrics``: prompt
    tokens the decode instance looked up in its tier and found there, and the blocks the
    prefill instance pushed, failed or dropped over TCP (those it has)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {}
    for url, names in (
        (decode_url, ("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits")),
        (prefill_url, ("pyxllm:kv_transfer_blocks",)),
    ):
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.name in names and sample.name.endswith("_total"):
                    outcome = sample.labels.get("outcome")
                    key = family.name.split(":")[1] + (f" {outcome}" if outcome else "")
                    counters[key] = counters.get(key, 0) + sample.value
    return counters


def measure(url: str, prompts, warmup, args, clients: int) -> dict:
    """One load run of ``clients`` clients against ``url`` after a request of ``warmup`` (the
    first request of a server also chooses its thread counts): the bench metrics, as a dict."""
    asyncio.run(run_benchmark(url + "/v1", warmup, 4, 1))
    records, duration = asyncio.run(
        run_benchmark(url + "/v1", prompts, args.output_tokens, clients)
    )
    metrics = compute_metrics(records, duration)
    if metrics.failed:
        errors = {r.error for r in records if not r.success}
        raise RuntimeError(f"{metrics.failed} requests failed: {errors}")
    return metrics.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--clients", type=int, nargs="+", default=[8], help="one or more levels")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: --clients")
    parser.add_argument(
        "--transfer",
        nargs="+",
        choices=("directory", "tcp"),
        default=["directory"],
        help="how the disaggregated set-ups move KV (one set-up each)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    warmup = make_prompts(tokenizer, 1, 128, seed=1)
    serve = ["serve", *([args.model] if args.model else []), "--disable-log-stats"]
    serve += ["--max-model-len", str(args.prompt_tokens + args.output_tokens + 64)]
    half = max(1, args.threads // 2)
    results: dict[tuple[int, str], dict] = {}
    with ExitStack() as stack:
        urls = {"colocated": stack.enter_context(started(serve, args.threads))}
        instances = {}
        for transfer in args.transfer:
            directory = stack.enter_context(tempfile.TemporaryDirectory())
            tier = [*serve, "--kv-offload-dir", directory, "--kv-role"]
            prefill, decode, env = [*tier, "prefill"], [*tier, "decode"], {}
            proxy = []
            if transfer == "tcp":
                listen = f"127.0.0.1:{free_port()}"
                own = stack.enter_context(tempfile.TemporaryDirectory())
                prefill[prefill.index(directory)] = own
                prefill += ["--kv-transfer-push", listen]
                decode += ["--kv-transfer-listen", listen]
                env = {"PYXLLM_KV_TRANSFER_TOKEN": secrets.token_hex(16)}
                proxy = ["--decode-kv-listen", listen]
            prefill_url = stack.enter_context(started(prefill, half, env=env))
            decode_url = stack.enter_context(started(decode, half, env=env))
            proxy = ["disagg-proxy", "--prefill", prefill_url, "--decode", decode_url, *proxy]
            name = "disaggregated" + (" over TCP" if transfer == "tcp" else "")
            urls[name] = stack.enter_context(started(proxy))
            instances[name] = (prefill_url, decode_url)
        for level, clients in enumerate(args.clients):
            count = args.num_prompts or clients
            prompts = make_prompts(tokenizer, count, args.prompt_tokens, seed=2 + level)
            for name, url in urls.items():
                results[clients, name] = measure(url, prompts, warmup, args, clients)
        moved = {name: kv_counters(*pair) for name, pair in instances.items()}
    print(
        f"prompts of {args.prompt_tokens} tokens, {args.output_tokens} tokens each; colocated "
        f"{args.threads} threads, disaggregated {half} + {half}"
    )
    for clients in args.clients:
        print(f"{clients} clients, {args.num_prompts or clients} prompts:")
        co = results[clients, "colocated"]
        for (level, name), m in results.items():
            if level != clients:
                continue
            ratios = ""
            if name != "colocated":
                ratios = (
                    " ("
                    + ", ".join(
                        f"{key[:-3].upper()} {stat} {m[key][stat] / co[key][stat]:.2f}x"
                        for key in ("ttft_ms", "tpot_ms")
                        for stat in ("mean", "median")
                    )
                    + ")"
                )
            print(
                f"  {name:>24}: TTFT mean {m['ttft_ms']['mean']:.0f} ms, median "
                f"{m['ttft_ms']['median']:.0f} ms; TPOT mean {m['tpot_ms']['mean']:.1f} ms, "
                f"median {m['tpot_ms']['median']:.1f} ms; {m['duration_s']:.1f} s{ratios}"
            )

    for name, counters in moved.items():
        print(f"{name}: " + ", ".join(f"{key} {value:.0f}" for key, value in counters.items()))


if __name__ == "__main__":
    main()
