"""Reporting benchmark results: a text table, a JSON file and a PNG plot (matplotlib).

matplotlib is the optional extra ``bench`` (``.venv/bin/pip install 'pyxllm[bench]'``); without
it the plot is skipped with a message and everything else is still written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pyxllm.benchmarks.metrics import BenchmarkMetrics, RequestRecord

_LATENCIES = (
    ("ttft_ms", "Time to first token"),
    ("tpot_ms", "Time per output token (excl. 1st)"),
    ("itl_ms", "Inter-token latency"),
    ("e2el_ms", "End-to-end latency"),
)


def _fmt(value: float) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.2f}"
    )


def format_table(metrics: BenchmarkMetrics, title: str = "Serving benchmark") -> str:
    """The metrics as a fixed-width text table (vLLM's layout: counts, throughputs, then
    mean/median/p99 of each latency in ms)."""
    width = 50
    rows = [
        ("Successful requests", str(metrics.completed)),
        ("Failed requests", str(metrics.failed)),
        ("Benchmark duration (s)", _fmt(metrics.duration_s)),
        ("Total input tokens", str(metrics.total_input_tokens)),
        ("Total generated tokens", str(metrics.total_output_tokens)),
        ("Request throughput (req/s)", _fmt(metrics.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(metrics.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(metrics.total_token_throughput)),
    ]
    lines = [f" {title} ".center(width, "="), *(f"{k:<36}{v:>14}" for k, v in rows)]
    for key, label in _LATENCIES:
        stats = getattr(metrics, key)
        lines.append(f" {label} ".center(width, "-"))
        for stat in ("mean", "median", "p99"):
            lines.append(
                f"{f'{stat.capitalize()} {key[:-3].upper()} (ms)':<36}{_fmt(stats[stat]):>14}"
            )
    lines.append("=" * width)
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (NaN written as ``null``); returns the path."""

    def clean(obj):
        if isinstance(obj, float) and math.isnan(obj):
            return None
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [clean(v) for v in obj]
        return obj

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(payload), indent=2) + "\n")
    return path


def plot_png(
    path: str | Path,
    metrics: BenchmarkMetrics,
    records: list[RequestRecord],
    title: str = "Serving benchmark",
) -> Path | None:
    """A 2x2 figure: per-request TTFT, TPOT, ITL and E2E latency histograms, with the mean,
    median and p99 marked. Returns the path, or ``None`` (with a message) without matplotlib."""
    try:
        # lazy: matplotlib is optional (pyxllm[bench])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        print(
            "matplotlib is not installed (.venv/bin/pip install 'pyxllm[bench]'); no plot written"
        )
        return None
    ok = [r for r in records if r.success]
    series = {
        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "itl_ms": [gap * 1000 for r in ok for gap in r.itls],
        "e2el_ms": [r.latency * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, label) in zip(axes.flat, _LATENCIES):
        values = series[key]
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)), color="#4C72B0", alpha=0.8)
        stats = getattr(metrics, key)
        for stat, style in (("mean", "-"), ("median", "--"), ("p99", ":")):
            if not math.isnan(stats[stat]):
                ax.axvline(
                    stats[stat], color="#C44E52", linestyle=style, label=f"{stat} {stats[stat]:.1f}"
                )
        ax.set_title(label)
        ax.set_xlabel("ms")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{title}: {metrics.completed} ok, {metrics.failed} failed, "
        f"{metrics.output_throughput:.1f} output tok/s, {metrics.request_throughput:.2f} req/s"
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
