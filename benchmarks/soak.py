"""Soak ``pyxllm serve`` with hostile clients for longer than the test suite allows.

For ``--minutes`` the mix of ``tests/entrypoints/openai/test_fuzz.py`` and
``tests/entrypoints/openai/test_load.py`` runs at once:

- fuzz: rounds of the seeded corpus of :mod:`tests.fuzz` (a new seed each round, the
  fixed cases every fifth), ``--fuzz-concurrency`` at a time, then ``n`` far above its bound;
- load: bursts of ``--streams`` streaming clients (temperature 0), a third hanging up after 1-3
  chunks, each kept stream compared with the same request answered alone beforehand;
- broken clients, in turn: a trickled body, bodies cut short, idle sockets, an unread stream,
  each with a normal request timed next to it.

Every ``--interval`` seconds it samples the server's RSS (``/proc/<pid>/status``), ``/health``'s
latency and ``/debug/stats``. At the end it prints throughput, errors by kind (with a few
reproductions) and the RSS trend, checks that the server is idle and healthy, and writes
``<out>.json`` (everything, the timeline included) and ``<out>.png`` (RSS, throughput, errors
and ``/health`` latency over time). It exits 1 when any request failed or the server was left
busy or unhealthy.

Run from the repository root (defaults shown); it starts its own server on the default model::

    .venv/bin/python benchmarks/soak.py --minutes 10 --out soak \\
        --server-args "--max-model-len 512 --kv-cache-memory 0.25"

or against a running one (give its process id for the RSS)::

    .venv/bin/python benchmarks/soak.py --minutes 60 --base-url http://127.0.0.1:8000 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.cases import CHAT_PATH, COMPLETIONS_PATH, bound_cases, generate_cases  # noqa: E402 - after the repository root is importable
from tests.fuzz.clients import (  # noqa: E402 - after the repository root is importable
    Result,
    compute_references,
    idle_sockets,
    is_idle,
    run_cases,
    server_rss_mb,
    short_body_then_close,
    short_body_then_half_close,
    stream_client,
    trickled_body,
    unread_stream,
    wait_idle,
)

LOAD_PROMPTS = {
    "chat": [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about rain."}],
    ],
    "completion": ["The quick brown fox", "def fibonacci(n):"],
}
PROMPT_S = 5.0  # a normal request next to a broken client: answered within this


def classify(problem: str) -> str:
    """The kind of a problem :func:`tests.fuzz.checks.check_case` (or a worker) reported."""
    rules = [
        ("no answer: ReadTimeout", "timeout"),
        ("no answer: PoolTimeout", "timeout"),
        ("no answer", "dropped connection"),
        ("not sent", "not sent"),
        ("answered 5", "5xx"),
        ("answered 200, expected", "200 where a 4xx was expected"),
        ("names param", "4xx naming the wrong param"),
        ("without OpenAI's error body", "4xx without the error body"),
        ("answered 4", "unexpected 4xx"),
        ("not strict JSON", "NaN, Infinity or invalid JSON"),
        ("logprob", "non-finite logprob"),
        ("greedy reference", "wrong text"),
        ("stream", "malformed stream"),
        ("slow", "slow next to a broken client"),
        ("differs", "stream differs from its reference"),
    ]
    return next((kind for prefix, kind in rules if prefix in problem), "other")


@dataclass
class Tally:
    """What the workers did, for the report and the timeline."""

    requests: Counter = field(default_factory=Counter)  # by worker
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by kind
    samples: list[dict] = field(default_factory=list)  # first failures, with repros
    normal_latencies: list[float] = field(default_factory=list)

    def fail(self, kind: str, detail: dict) -> None:
        self.errors[kind] += 1
        if sum(1 for s in self.samples if s["kind"] == kind) < 5:
            self.samples.append({"kind": kind, **detail})


async def fuzz_worker(base: str, model: str, args, tally: Tally, stop_at: float) -> None:
    round_no = 0
    while time.monotonic() < stop_at:
        seed = args.seed + round_no
        cases = generate_cases(seed, args.fuzz_round, model, fixed=round_no % 5 == 0)
        references = await compute_references(base, cases)

        def record(result: Result, seed=seed) -> None:
            tally.requests["fuzz"] += 1
            tally.statuses[result.status] += 1
            for problem in result.problems[:1]:
                tally.fail(
                    classify(problem),
                    {
                        "seed": seed,
                        "request": result.case.describe(400),
                        "problem": problem[:600],
                        "repro": result.case.repro(base)[:1500],
                    },
                )

        await run_cases(
            base,
            cases,
            args.fuzz_concurrency,
            references=references,
            deadline=stop_at,
            on_result=record,
        )
        for case in bound_cases(model):
            if time.monotonic() >= stop_at:
                break
            await run_cases(base, [case], 1, timeout=20, on_result=record)
        round_no += 1


async def load_worker(base: str, args, tally: Tally, stop_at: float) -> None:
    references = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for kind, prompts in LOAD_PROMPTS.items():
            for prompt in prompts:
                body = _load_body(kind, prompt)
                response = await client.post(
                    CHAT_PATH if kind == "chat" else COMPLETIONS_PATH, json=body
                )
                choice = response.json()["choices"][0]
                text = choice["message"]["content"] if kind == "chat" else choice["text"]
                references[json.dumps(body, sort_keys=True)] = text
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=0)
    while time.monotonic() < stop_at:
        plan = []
        for i in range(args.streams):
            kind = "chat" if i % 2 == 0 else "completion"
            prompt = rng.choice(LOAD_PROMPTS[kind])
            hang_up = rng.randint(1, 3) if rng.random() < 1 / 3 else None
            plan.append((kind, _load_body(kind, prompt), hang_up))
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:
            outcomes = await asyncio.gather(*(stream_client(client, *p) for p in plan))
        for outcome in outcomes:
            tally.requests["load"] += 1
            tally.statuses[outcome.status] += 1
            if outcome.problems:
                tally.fail(classify(outcome.problems[0]), {"load": outcome.problems[0][:600]})
            elif not outcome.hung_up:
                want = references[json.dumps(outcome.body, sort_keys=True)]
                if outcome.text != want:
                    detail = f"{outcome.kind} {outcome.body}: {outcome.text!r} != {want!r}"
                    tally.fail("stream differs from its reference", {"load": detail})


def _load_body(kind: str, prompt) -> dict:
    body = {"temperature": 0, "max_tokens": 8}
    body.update({"messages": prompt} if kind == "chat" else {"prompt": prompt})
    return body


async def _normal_request(base: str, tally: Tally, next_to: str) -> None:
    start = time.monotonic()
    body = {"messages": LOAD_PROMPTS["chat"][0], "max_tokens": 2, "temperature": 0}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            response = await client.post(CHAT_PATH, json=body)
        ok = response.status_code == 200
    except httpx.HTTPError as exc:
        ok, response = False, exc
    seconds = time.monotonic() - start
    tally.requests["broken"] += 1
    tally.normal_latencies.append(seconds)
    if not ok:
        tally.fail("normal request failed next to a broken client", {next_to: repr(response)})
    elif seconds > PROMPT_S:
        tally.fail("slow next to a broken client", {next_to: f"{seconds:.1f} s"})


async def broken_worker(base: str, host: str, port: int, tally: Tally, stop_at: float) -> None:
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    step = 0
    while time.monotonic() < stop_at:
        kind = ("trickle", "cut short", "idle sockets", "unread stream")[step % 4]
        step += 1
        try:
            if kind == "trickle":
                slow = asyncio.ensure_future(trickled_body(host, port, body, 3, 0.2))
                await asyncio.sleep(1.0)
                await _normal_request(base, tally, kind)
                status, _ = await slow
                if status not in (200, 408):
                    tally.fail("trickled request not answered", {kind: status})
            elif kind == "cut short":
                waiting = [
                    asyncio.ensure_future(
                        short_body_then_half_close(host, port, 1000, b'{"prompt": "Hi", "max', 20)
                    )
                    for _ in range(5)
                ]
                await _normal_request(base, tally, kind)
                for _ in range(10):
                    await short_body_then_close(host, port, 1000, b'{"prompt": "He')
                for status in await asyncio.gather(*waiting):
                    if status is not None and not 400 <= status < 500:
                        tally.fail("cut-short body answered badly", {kind: status})
            elif kind == "idle sockets":
                sockets = idle_sockets(host, port, 16, False) + idle_sockets(host, port, 16, True)
                await asyncio.sleep(0.5)
                await _normal_request(base, tally, kind)
                for sock in sockets:
                    sock.close()
            else:
                body_unread = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True}
                sock = unread_stream(host, port, {**body_unread, "n": 4, "logprobs": 5})
                await asyncio.sleep(2.0)
                await _normal_request(base, tally, kind)
                sock.close()
        except OSError as exc:
            tally.fail("broken client could not connect", {kind: repr(exc)})
        await asyncio.sleep(1.0)


async def sampler(base: str, pid: int | None, tally: Tally, interval: float, stop_at: float):
    timeline = []
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while True:
            now = time.monotonic()
            try:
                t0 = time.monotonic()
                health = (await client.get("/health")).status_code
                health_s = time.monotonic() - t0
                stats = (await client.get("/debug/stats")).json()
            except httpx.HTTPError as exc:
                health, health_s, stats = repr(exc), None, {}
            timeline.append(
                {
                    "t": round(now - start, 2),
                    "rss_mb": _rss(pid),
                    "health": health,
                    "health_s": health_s,
                    "num_running": stats.get("num_running"),
                    "num_waiting": stats.get("num_waiting"),
                    "kv_blocks_used": stats.get("num_kv_blocks_used"),
                    "requests": dict(tally.requests),
                    "errors": sum(tally.errors.values()),
                }
            )
            if now >= stop_at:
                return timeline
            await asyncio.sleep(min(interval, max(stop_at - now, 0.1)))


async def soak(base: str, pid: int | None, args) -> dict:
    host, port = httpx.URL(base).host, httpx.URL(base).port or 80
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    tally = Tally()
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    timeline, *_ = await asyncio.gather(
        sampler(base, pid, tally, args.interval, stop_at),
        fuzz_worker(base, model, args, tally, stop_at),
        load_worker(base, args, tally, stop_at),
        broken_worker(base, host, port, tally, stop_at),
    )
    elapsed = time.monotonic() - start
    stats = wait_idle(base, timeout=30)
    try:
        health = httpx.get(base + "/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        health = repr(exc)
    rss = [s["rss_mb"] for s in timeline if s["rss_mb"] is not None]
    late = [(s["t"], s["rss_mb"]) for s in timeline[len(timeline) // 2 :] if s["rss_mb"]]
    return {
        "minutes": args.minutes,
        "seed": args.seed,
        "seconds": round(elapsed, 1),
        "requests": dict(tally.requests),
        "requests_per_s": round(sum(tally.requests.values()) / elapsed, 2),
        "statuses": {str(k): v for k, v in tally.statuses.items()},
        "errors": dict(tally.errors),
        "error_samples": tally.samples,
        "normal_request_s": {
            "max": max(tally.normal_latencies, default=None),
            "mean": sum(tally.normal_latencies) / len(tally.normal_latencies)
            if tally.normal_latencies
            else None,
        },
        "rss_mb": {
            "start": rss[0] if rss else None,
            "end": rss[-1] if rss else None,
            "max": max(rss) if rss else None,
            "second_half_mb_per_min": _slope(late) * 60 if len(late) > 2 else None,
        },
        "final": {"health": health, "stats": stats, "idle": is_idle(stats)},
        "timeline": timeline,
    }


def _rss(pid: int | None) -> float | None:
    try:
        return server_rss_mb(pid) if pid else None
    except (OSError, RuntimeError):  # the server is gone
        return None


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points, per second."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var if var else 0.0


def plot(report: dict, path: Path) -> None:
    """RSS, throughput, errors and /health latency over time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    t = [s["t"] / 60 for s in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    axes[0].plot(t, [s["rss_mb"] for s in timeline], color="tab:red")
    axes[0].set_ylabel("server RSS (MiB)")
    window = 5  # samples: streams finish in bursts, a rate per sample would zigzag
    for worker in ("fuzz", "load", "broken"):
        counts = [s["requests"].get(worker, 0) for s in timeline]
        rates = [
            (counts[i] - counts[max(i - window, 0)])
            / max((t[i] - t[max(i - window, 0)]) * 60, 1e-9)
            for i in range(len(counts))
        ]
        axes[1].plot(t, rates, label=worker)
    axes[1].set_ylabel(f"requests / s ({window} samples)")
    axes[1].legend()
    axes[2].plot(t, [s["errors"] for s in timeline], color="tab:orange")
    axes[2].set_ylabel("failed requests (total)")
    axes[3].plot(t, [s["health_s"] for s in timeline], color="tab:green")
    axes[3].set_ylabel("/health latency (s)")
    axes[3].set_xlabel("minutes")
    fig.suptitle(f"pyxllm soak, seed {report['seed']}: {report['requests_per_s']} requests/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(report: dict) -> None:
    print(f"soak: {report['seconds']} s, seed {report['seed']}")
    print(f"  requests: {report['requests']} ({report['requests_per_s']}/s)")
    print(f"  statuses: {report['statuses']}")
    print(f"  normal request next to broken clients: {report['normal_request_s']}")
    print(f"  RSS (MiB): {report['rss_mb']}")
    print(f"  errors by kind: {report['errors'] or 'none'}")
    for sample in report["error_samples"][:10]:
        print(f"    - {json.dumps(sample)[:800]}")
    print(f"  at the end: {report['final']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long (default: 5)")
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--pid", type=int, help="the running server's process id, for its RSS")
    parser.add_argument(
        "--server-args",
        default="--max-model-len 512 --kv-cache-memory 0.25",
        help="flags of the server this starts",
    )
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--fuzz-round", type=int, default=600, help="requests per fuzz round")
    parser.add_argument("--fuzz-concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=48, help="streaming clients per burst")
    parser.add_argument("--interval", type=float, default=2.0, help="sampling period, seconds")
    parser.add_argument("--out", default="soak", help="writes <out>.json and <out>.png")
    args = parser.parse_args(argv)

    if args.base_url:
        report = asyncio.run(soak(args.base_url.rstrip("/"), args.pid, args))
    else:
        from tests.utils import RemoteServer

        with RemoteServer(shlex.split(args.server_args)) as server:
            base = f"http://{server.host}:{server.port}"
            report = asyncio.run(soak(base, server.proc.pid, args))
    json_path, png_path = Path(f"{args.out}.json"), Path(f"{args.out}.png")
    json_path.write_text(json.dumps(report, indent=1, default=str))
    plot(report, png_path)
    print_report(report)
    print(f"wrote {json_path} and {png_path}")
    failed = bool(report["errors"]) or not report["final"]["idle"]
    return 1 if failed or report["final"]["health"] != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
