"""The periodic stats line: throughputs over the interval, request counts, cache figures, the
speculative decoding line with per-position acceptance, and silence while idle."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pyxllm.engine.stat_logger import LoggingStatLogger


def fake_metrics() -> SimpleNamespace:
    """What the logger reads of ``EngineMetrics``, at zero."""
    return SimpleNamespace(
        num_prompt_tokens=0,
        num_generation_tokens=0,
        num_finished=0,
        num_spec_drafts=0,
        num_spec_draft_tokens=0,
        num_spec_accepted=0,
        spec_accepted_per_pos=[],
        scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0),
        kv=SimpleNamespace(num_queries=0, num_hits=0, usage=0.0),
    )


def test_lines_report_the_interval(caplog):
    metrics = fake_metrics()
    stats = LoggingStatLogger(metrics, 10.0, now=0.0, num_speculative_tokens=3)
    caplog.set_level(logging.INFO, logger="pyxllm.engine.stats")
    assert not stats.maybe_log(5.0)  # too early
    assert not stats.maybe_log(10.0)  # nothing happened
    metrics.num_prompt_tokens, metrics.num_generation_tokens = 400, 120
    metrics.scheduler.running, metrics.scheduler.waiting = [1, 2], [3]
    metrics.kv.num_queries, metrics.kv.num_hits, metrics.kv.usage = 400, 100, 0.125
    metrics.num_spec_drafts, metrics.num_spec_draft_tokens = 20, 60
    metrics.num_spec_accepted, metrics.spec_accepted_per_pos = 25, [15, 10]
    assert stats.maybe_log(30.0)
    main, spec = caplog.messages
    assert main == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 6.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, Preempted: 0 reqs, KV cache usage: 12.5%, "
        "Prefix cache hit rate: 25.0%"
    )
    assert spec == (
        "SpecDecoding metrics: Mean acceptance length: 2.25, Accepted throughput: 1.2 tokens/s, "
        "Drafted throughput: 3.0 tokens/s, Accepted: 25 tokens, Drafted: 60 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.000, Avg Draft acceptance rate: 41.7%"
    )
    caplog.clear()
    metrics.scheduler.running, metrics.scheduler.waiting = [], []
    metrics.num_generation_tokens, metrics.num_finished = 130, 3
    assert stats.maybe_log(40.0)  # requests finished: one last line, without drafts
    assert len(caplog.messages) == 1 and "generation throughput: 1.0 tokens/s" in caplog.text
    assert "hit rate: 25.0%" in caplog.text  # no new lookups: the whole run's rate
    assert not stats.maybe_log(50.0)  # idle again


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="--stats-interval: must be > 0"):
        LoggingStatLogger(fake_metrics(), 0, now=0.0)
