"""What the benchmark scripts share: serving pyxllm (or a peer) as a subprocess on a port,
driving it with ``pyxllm bench serve``'s client, and printing pyxllm's ratio to each peer.

A leaf: the scripts import it, it imports none of them (``compare.py`` and its section modules,
``llama_server.py``, ``model_1b.py``, ``invariance.py`` ..., once imported each other).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time

from pyxllm.benchmarks.metrics import compute_metrics
from pyxllm.benchmarks.serve import run_benchmark

# pyxllm runs with its fastest CPU runner: decode steps replayed from TorchScript traces
GRAPH_BACKEND = "graph"


def log(*parts) -> None:
    print(*parts, flush=True)


def pyxllm_serve_cmd(port: int, *flags: str) -> list[str]:
    """The command serving with pyxllm (this interpreter's ``pyxllm serve``) on ``port``, with
    ``flags``."""
    return [sys.executable, "-m", "pyxllm", "serve", "--port", str(port), *flags]


def start_server(name: str, cmd: list[str], port: int, threads: int) -> subprocess.Popen:
    """Start the server ``cmd`` with ``threads`` OpenMP threads and wait until it answers ``GET
    http://127.0.0.1:{port}/v1/models`` (at most 300 s). Its output goes to a temporary file,
    whose tail the error shows if it exits first.

    Raises:
        RuntimeError: the server exited during start-up.
        TimeoutError: it did not answer within 300 s.
    """
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    output = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output.seek(0)
            tail = output.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{name} did not start within 300 s")


def resident_mib(pid: int) -> float | None:
    """Process ``pid``'s resident memory (``VmRSS``) in MiB, or None without ``/proc``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def measure_server(
    name: str,
    cmd: list[str],
    port: int,
    threads: int,
    loads: dict[str, tuple[list, int, int]],
    warmup: list,
) -> dict[str, dict]:
    """Start the server ``cmd``, send it the ``warmup`` prompts (4 new tokens, 2 clients), then
    each load ``label: (prompts, output_len, clients)`` (or ``(..., model_names)``: the
    requests name those models in turn) in turn through ``pyxllm bench serve``'s client, and
    stop it. Returns ``label: figures``: aggregate output tok/s, median
    TTFT and TPOT in ms, completed and failed requests, output tokens, and the server's
    resident memory in MiB once it answered (``VmRSS``; None where ``/proc`` has none)."""
    proc = start_server(name, cmd, port, threads)
    resident = resident_mib(proc.pid)
    results = {}
    try:
        url = f"http://127.0.0.1:{port}/v1"
        asyncio.run(run_benchmark(url, warmup, 4, 2))
        for label, (prompts, output_len, clients, *names) in loads.items():
            records, duration = asyncio.run(
                run_benchmark(
                    url, prompts, output_len, clients, model_names=names[0] if names else None
                )
            )
            m = compute_metrics(records, duration)
            results[label] = {
                "output_tok_s": m.output_throughput,
                "median_ttft_ms": m.ttft_ms["median"],
                "median_tpot_ms": m.tpot_ms["median"],
                "completed": m.completed,
                "failed": m.failed,
                "total_output_tokens": m.total_output_tokens,
                "resident_mib_after_start": resident,
            }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return results


def ratio_lines(
    title: str, ours: float | None, peers: dict[str, float | None], unit: str, lower_better=False
) -> list[str]:
    lines = [f"{title}: pyxllm {ours:.1f} {unit}" if ours is not None else f"{title}: pyxllm n/a"]
    for peer, value in peers.items():
        if value is None or ours is None:
            lines.append(f"    vs {peer}: skipped")
            continue
        r = value / ours if lower_better else ours / value
        lines.append(
            f"    vs {peer}: {value:.1f} {unit} -> pyxllm/{peer} = "
            f"{r:.2f}x{' (lower is better, shown inverted)' if lower_better else ''}"
        )
    return lines
