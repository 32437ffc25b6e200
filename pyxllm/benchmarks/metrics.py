"""Serving metrics from per-request timings, with the definitions of vLLM's ``benchmark_serving``.

For one request sent at ``start`` whose streamed output chunks arrived at ``t_1 .. t_n``:

- TTFT (time to first token) = ``t_1 - start``.
- ITL (inter-token latency) = each gap ``t_{i+1} - t_i`` between chunks carrying text (a chunk
  may carry several tokens; the gap is then counted once, as vLLM does).
- TPOT (time per output token, first excluded) = ``(latency - TTFT) / (output_tokens - 1)``,
  defined when ``output_tokens > 1``.
- E2E latency = ``t_end - start``, where ``t_end`` is when the stream closed.

Aggregates: mean, median and p99 (linear interpolation between order statistics, numpy's
default) of each, in milliseconds; throughput over the benchmark's wall duration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """What one request measured (times in seconds, from ``time.perf_counter``).

    Attributes:
        prompt_tokens: tokens in the prompt (as the server reported, else as sent).
        output_tokens: tokens generated (the server's ``usage``, else the number of chunks).
        start: when the request was sent; chunk_times: arrival of each chunk carrying text;
        end: when the response was complete.
        success: whether it completed; error: why not.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; ``nan`` if empty.

    ``percentile([1, 2, 3, 4], 50) == 2.5``; ``percentile([0, 10], 99) == 9.9``.
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values_s: list[float]) -> dict[str, float]:
    """``{"mean", "median", "p99"}`` of durations given in seconds, reported in milliseconds."""
    if not values_s:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p99": percentile(ms, 99)}


@dataclass(slots=True)
class BenchmarkMetrics:
    """The figures ``pyxllm bench serve`` reports (latencies in ms, throughputs per second)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> BenchmarkMetrics:
    """Aggregate the successful ``records`` of a run that lasted ``duration_s`` seconds.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=summarize([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=summarize([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=summarize([gap for r in ok for gap in r.itls]),
        e2el_ms=summarize([r.latency for r in ok]),
    )
