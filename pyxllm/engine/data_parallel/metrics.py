"""``/metrics`` and ``/debug/stats`` over data-parallel replicas: each replica's own figures,
labelled with its index, and their total.

Prometheus: every sample of a replica's exposition (:mod:`pyxllm.engine.metrics`: vLLM's
names, labelled ``model_name``) comes back with a ``replica`` label (``"0"``, ``"1"`` ...), and
each series also appears once without it, as the total over the live replicas: the sum, but
for ``vllm:kv_cache_usage_perc`` (the replicas' used blocks over their blocks, a fraction) and
the ``*_created`` timestamps (the earliest). A query summing a metric over every series must
therefore pick one kind: ``sum(x{replica!=""})`` or ``x{replica=""}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pyxllm.engine.data_parallel.wire import ScrapeReply

# the gauge that is a fraction of each replica's KV blocks (totalled weighted by the blocks)
USAGE_FRACTION = "vllm:kv_cache_usage_perc"
# stats keys that describe a replica rather than count something (not summed)
_NOT_SUMMED = {"pid", "replica"}


def merge_metrics(replies: Mapping[int, ScrapeReply]) -> list[Metric]:
    """The replicas' metric families (``replica -> its scrape``), each with the total series
    first, then every replica's (see the module doc)."""
    families: dict[str, Metric] = {}
    per_replica: dict[str, list[tuple[str, dict, float]]] = {}
    totals: dict[str, dict[tuple, list[tuple[float, float]]]] = {}
    for index in sorted(replies):
        reply = replies[index]
        blocks = float(reply.stats.get("num_kv_blocks_total", 1) or 1)
        for family in text_string_to_metric_families(reply.metrics_text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = {**sample.labels, "replica": str(index)}
                per_replica.setdefault(family.name, []).append((sample.name, labels, sample.value))
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals.setdefault(family.name, {}).setdefault(key, []).append(
                    (sample.value, blocks)
                )
    for name, metric in families.items():
        for (sample_name, labels), values in totals.get(name, {}).items():
            metric.add_sample(sample_name, dict(labels), _total(name, values))
        for sample_name, labels, value in per_replica.get(name, ()):
            metric.add_sample(sample_name, labels, value)
    return list(families.values())


def _total(family: str, values: list[tuple[float, float]]) -> float:
    """One series' total over the replicas, from ``(value, replica's KV blocks)`` pairs."""
    if family.endswith("_created"):
        return min(value for value, _ in values)
    if family == USAGE_FRACTION:
        blocks = sum(weight for _, weight in values)
        return sum(value * weight for value, weight in values) / blocks
    return sum(value for value, _ in values)


def total_stats(per_replica: list[dict]) -> dict[str, int | float]:
    """The sum of the replicas' ``LLMEngine.stats()`` counters, key by key."""
    totals: dict[str, int | float] = {}
    for stats in per_replica:
        for key, value in stats.items():
            if key not in _NOT_SUMMED and isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
    return totals


class _ReplicasCollector(Collector):
    """Scrapes the live replicas when Prometheus scrapes (``scrape()`` -> replica -> reply)."""

    def __init__(self, scrape) -> None:
        self.scrape = scrape

    def collect(self) -> Iterator[Metric]:
        yield from merge_metrics(self.scrape())


class DataParallelMetrics:
    """What ``/metrics`` renders for a data-parallel server: :attr:`registry` collects from the
    replicas at scrape time (``scrape``: a call returning ``{replica: ScrapeReply}`` of the live
    ones; it blocks for their answers, so the server calls it off its event loop)."""

    def __init__(self, scrape) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicasCollector(scrape))
