"""The serving engine's periodic stats line (vLLM's ``LoggingStatLogger``, with its speculative
decoding line), so an operator reading the log sees what the server is doing.

Every ``interval_s`` seconds while there is work (a request ran, waits, or finished since the
last line), one INFO line::

    Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 8 reqs, Waiting: 2 reqs, Preempted: 0 reqs, KV cache usage: 31.2%,
    Prefix cache hit rate: 45.0%

and with speculative decoding a second one::

    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 40.1 tokens/s,
    Drafted throughput: 120.4 tokens/s, Accepted: 401 tokens, Drafted: 1204 tokens,
    Per-position acceptance rate: 0.712, 0.401, 0.198, Avg Draft acceptance rate: 33.3%

Throughputs and ``Preempted`` cover the interval since the last line; the prefix cache hit rate
is over the interval's admitted tokens (the whole run's when none were admitted); acceptance
figures are the interval's, as vLLM's: mean acceptance length ``1 + accepted / drafts`` (tokens
a drafted step emits), per-position rate ``accepted at position i / drafts``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyxllm.engine.metrics import EngineMetrics

logger = logging.getLogger("pyxllm.engine.stats")


@dataclass(frozen=True, slots=True)
class _Totals:
    """The counters a line reports differences of."""

    prompt_tokens: int
    generation_tokens: int
    finished: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]

    @classmethod
    def read(cls, metrics: EngineMetrics) -> _Totals:
        return cls(
            metrics.num_prompt_tokens,
            metrics.num_generation_tokens,
            metrics.num_finished,
            metrics.scheduler.num_preemptions,
            metrics.kv.num_queries,
            metrics.kv.num_hits,
            metrics.num_spec_drafts,
            metrics.num_spec_draft_tokens,
            metrics.num_spec_accepted,
            tuple(metrics.spec_accepted_per_pos),
        )


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


class LoggingStatLogger:
    """Logs the stats line of one engine (see the module doc); call :meth:`maybe_log` from the
    engine loop, as often as it turns (it logs at most once per ``interval_s``).

    Args:
        metrics: the engine's :class:`~pyxllm.engine.metrics.EngineMetrics`.
        interval_s: seconds between lines (``--stats-interval``), > 0.
        now: the ``time.monotonic()`` the first interval starts at.
        num_speculative_tokens: ``k`` of speculative decoding (0 without): the per-position
            rates show every position, those never accepted too.
    """

    def __init__(
        self, metrics: EngineMetrics, interval_s: float, now: float, num_speculative_tokens: int = 0
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"--stats-interval: must be > 0, got {interval_s}")
        self.metrics, self.interval_s = metrics, interval_s
        self.num_speculative_tokens = num_speculative_tokens
        self._last_time, self._last = now, _Totals.read(metrics)

    def maybe_log(self, now: float) -> bool:
        """Log the line if ``interval_s`` has passed and there was work; whether it logged."""
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return False
        scheduler, last, totals = self.metrics.scheduler, self._last, _Totals.read(self.metrics)
        self._last_time, self._last = now, totals
        if totals == last and not scheduler.running and not scheduler.waiting:
            return False  # idle: nothing to say
        queries = totals.prefix_queries - last.prefix_queries
        hits = totals.prefix_hits - last.prefix_hits
        if not queries:
            queries, hits = totals.prefix_queries, totals.prefix_hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, Preempted: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            (totals.prompt_tokens - last.prompt_tokens) / elapsed,
            (totals.generation_tokens - last.generation_tokens) / elapsed,
            len(scheduler.running),
            len(scheduler.waiting),
            totals.preemptions - last.preemptions,
            100.0 * self.metrics.kv.usage,
            _percent(hits, queries),
        )
        drafts = totals.drafts - last.drafts
        if drafts:
            self._log_spec_decode(last, totals, drafts, elapsed)
        return True

    def _log_spec_decode(self, last: _Totals, totals: _Totals, drafts: int, elapsed: float) -> None:
        accepted = totals.accepted - last.accepted
        drafted = totals.draft_tokens - last.draft_tokens
        positions = max(self.num_speculative_tokens, len(totals.accepted_per_pos))

        def padded(counts: tuple[int, ...]) -> tuple[int, ...]:
            return counts + (0,) * (positions - len(counts))

        per_pos = [
            (now - then) / drafts
            for now, then in zip(padded(totals.accepted_per_pos), padded(last.accepted_per_pos))
        ]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.1f "
            "tokens/s, Drafted throughput: %.1f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted / elapsed,
            drafted / elapsed,
            accepted,
            drafted,
            ", ".join(f"{rate:.3f}" for rate in per_pos) or "-",
            _percent(accepted, drafted),
        )
