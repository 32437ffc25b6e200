"""Prometheus metrics of one engine, under vLLM's names, each labelled with ``model_name``.

State read at scrape time (always current, nothing to update per step):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(a fraction, 0 to 1, of KV blocks referenced by live requests), and the counters
``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (in
tokens). Recorded by the engine as requests progress: ``vllm:prompt_tokens``,
``vllm:generation_tokens``, ``vllm:request_success{finished_reason}`` and the histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
``vllm:e2e_request_latency_seconds``; with speculative decoding ``vllm:spec_decode_num_drafts``
(sequence-steps that verified drafts), ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos
{position}`` (drafts accepted at each draft position, 0-based). vLLM has no count of requests
that failed in the engine (their own processing raised, see ``LLMEngine._fail``; they also
count as ``aborted`` successes, as vLLM's do), so ours has its own name:
``pyxllm:request_failures{cause}``, ``cause`` one of ``FAILURE_CAUSES``. With the disk KV tier
(``--kv-offload-dir``), vLLM's names for a KV connector's prefix cache and offload traffic:
``vllm:external_prefix_cache_queries`` and ``vllm:external_prefix_cache_hits`` (tokens looked
up in the tier, each request once, and tokens read back from it: their difference is the
misses) and ``vllm:kv_offload_total_bytes{transfer_type}`` (payload bytes, ``transfer_type``
``CPU_to_DISK`` written or ``DISK_to_CPU`` read), with ``pyxllm:kv_offload_blocks
{transfer_type}`` (the same transfers in blocks) and ``pyxllm:kv_offload_rejected_blocks``
(files that failed their check: torn, truncated or foreign, read as misses); with KV over TCP
(``--kv-transfer-push`` or ``--kv-transfer-listen``) ``pyxllm:kv_transfer_blocks{outcome}``
(``pushed``, ``failed``, ``dropped``; ``received``, ``refused``). Counters are
exposed with prometheus_client's ``_total`` suffix, as vLLM's are.

The collectors live in a per-engine ``CollectorRegistry`` (``EngineMetrics.registry``), so
several engines in one process do not clash; ``prometheus_client.generate_latest(registry)``
renders them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.kv_connector import KVTierConnector
from pyxllm.engine.request import Request, RequestStatus
from pyxllm.engine.scheduler import Scheduler

# seconds
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
FINISHED_REASONS = tuple(s.value for s in RequestStatus if s.finished)
# why a request failed in the engine: its structured-output constraint, or anything else
FAILURE_CAUSES = ("constraint", "other")


class _StateCollector(Collector):
    """Scheduler and KV cache state, read when Prometheus scrapes."""

    def __init__(
        self,
        model_name: str,
        scheduler: Scheduler,
        kv: KVCacheManager,
        kv_connector: KVTierConnector | None = None,
    ) -> None:
        self.model_name, self.scheduler, self.kv = model_name, scheduler, kv
        self.kv_connector = kv_connector  # its requests whose blocks are read wait too

    def collect(self) -> Iterator[Metric]:
        label = [self.model_name]
        loading = 0 if self.kv_connector is None else len(self.kv_connector.loading)
        values = [
            (
                GaugeMetricFamily,
                "vllm:num_requests_running",
                "Requests in model execution batches.",
                len(self.scheduler.running),
            ),
            (
                GaugeMetricFamily,
                "vllm:num_requests_waiting",
                "Requests waiting to be processed.",
                len(self.scheduler.waiting) + loading,
            ),
            (
                GaugeMetricFamily,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage: 1 means 100 percent of the blocks are referenced by live "
                "requests.",
                self.kv.usage,
            ),
            (
                CounterMetricFamily,
                "vllm:num_preemptions",
                "Cumulative number of preemptions.",
                self.scheduler.num_preemptions,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in tokens (the tokens of each admitted request).",
                self.kv.num_queries,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in tokens found cached.",
                self.kv.num_hits,
            ),
        ]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(label, value)
            yield metric


class _TotalsCollector(Collector):
    """The token and speculative decoding totals of :class:`EngineMetrics`, read when
    Prometheus scrapes."""

    def __init__(self, model_name: str, metrics: EngineMetrics) -> None:
        self.model_name, self.metrics = model_name, metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prefill tokens processed.", m.num_prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed.", m.num_generation_tokens),
            ("vllm:spec_decode_num_drafts", "Speculative drafts verified.", m.num_spec_drafts),
            (
                "vllm:spec_decode_num_draft_tokens",
                "Speculative draft tokens.",
                m.num_spec_draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                m.num_spec_accepted,
            ),
        ):
            metric = CounterMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(m.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos


class _TierCollector(Collector):
    """The disk KV tier's counters (:class:`KVTierConnector`), read when Prometheus scrapes."""

    def __init__(self, model_name: str, connector: KVTierConnector) -> None:
        self.model_name, self.connector = model_name, connector

    def collect(self) -> Iterator[Metric]:
        label, connector, tier = [self.model_name], self.connector, self.connector.tier
        for name, doc, value in (
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache (the disk KV tier) queries, in tokens.",
                connector.num_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache (the disk KV tier) hits, in tokens.",
                connector.num_hits,
            ),
            (
                "pyxllm:kv_offload_rejected_blocks",
                "Disk KV tier files that failed their check (read as misses).",
                tier.rejected,
            ),
        ):
            metric = CounterMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric(label, value)
            yield metric
        transfers = (("CPU_to_DISK", tier.blocks_written, tier.bytes_written),)
        transfers += (("DISK_to_CPU", tier.hits, tier.bytes_read),)
        for name, doc, column in (
            ("vllm:kv_offload_total_bytes", "KV bytes moved to and from the disk tier.", 2),
            ("pyxllm:kv_offload_blocks", "KV blocks moved to and from the disk tier.", 1),
        ):
            metric = CounterMetricFamily(name, doc, labels=["model_name", "transfer_type"])
            for row in transfers:
                metric.add_metric([self.model_name, row[0]], row[column])
            yield metric
        counts = connector.transfer_counts()
        if counts:
            metric = CounterMetricFamily(
                "pyxllm:kv_transfer_blocks",
                "KV blocks over TCP by outcome: pushed (acknowledged), failed, dropped (never "
                "sent: a peer's queue full or the peer skipped after a failure), received, "
                "refused.",
                labels=["model_name", "outcome"],
            )
            for outcome, value in counts.items():
                metric.add_metric([self.model_name, outcome], value)
            yield metric


class EngineMetrics:
    """The Prometheus collectors of one engine (see the module doc for what each means);
    ``kv_connector``: the disk KV tier's, when the engine has one."""

    def __init__(
        self,
        model_name: str,
        scheduler: Scheduler,
        kv: KVCacheManager,
        kv_connector: KVTierConnector | None = None,
    ) -> None:
        self.scheduler, self.kv = scheduler, kv
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(model_name, scheduler, kv, kv_connector))
        if kv_connector is not None:
            self.registry.register(_TierCollector(model_name, kv_connector))
        label, kw = ["model_name"], {"registry": self.registry}
        success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            **kw,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        failures = Counter(
            "pyxllm:request_failures",
            "Requests that failed in the engine, by cause.",
            ["model_name", "cause"],
            **kw,
        )
        self.request_failures = {c: failures.labels(model_name, c) for c in FAILURE_CAUSES}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            label,
            buckets=TTFT_BUCKETS,
            **kw,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens in seconds.",
            label,
            buckets=ITL_BUCKETS,
            **kw,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            label,
            buckets=E2E_BUCKETS,
            **kw,
        ).labels(model_name)
        # totals that the engine's stats and the periodic log line read too, exported at
        # scrape time by _TotalsCollector; spec_accepted_per_pos[i]: drafts accepted at
        # position i
        self.num_prompt_tokens = self.num_generation_tokens = self.num_finished = 0
        self.num_spec_drafts = self.num_spec_draft_tokens = self.num_spec_accepted = 0
        self.spec_accepted_per_pos: list[int] = []
        self.registry.register(_TotalsCollector(model_name, self))

    def record_spec_decode(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence verified ``num_draft_tokens`` drafts this step and accepted the first
        ``num_accepted``."""
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_draft_tokens
        self.num_spec_accepted += num_accepted
        per_pos = self.spec_accepted_per_pos
        per_pos.extend([0] * (num_accepted - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def record_tokens(self, new_tokens: Iterable[tuple[Request, list[int]]], now: float) -> None:
        """Each request got its new tokens at ``now`` (``time.monotonic()`` seconds): one, or
        with speculative decoding several from one step.

        Stamps ``first_token_time`` / ``last_token_time`` on the requests and observes TTFT
        (from ``arrival_time``) or the inter-token latency (once per step, as vLLM does).
        """
        count = 0
        for request, tokens in new_tokens:
            count += len(tokens)
            if request.first_token_time is None:
                request.first_token_time = now
                self.ttft.observe(now - request.arrival_time)
                self.num_prompt_tokens += request.num_prompt_tokens
            else:
                self.itl.observe(now - request.last_token_time)
            request.last_token_time = now
        self.num_generation_tokens += count

    def record_failed(self, cause: str) -> None:
        """A request failed in the engine because of ``cause`` (one of ``FAILURE_CAUSES``)."""
        self.request_failures[cause].inc()

    def record_pooled(self, request: Request, now: float) -> None:
        """An embedding request ended at ``now`` with its pooled vector: its prompt tokens
        count as processed (it gets no token, so :meth:`record_tokens` never sees it)."""
        self.num_prompt_tokens += request.num_prompt_tokens
        self.record_finished(request, now)

    def record_finished(self, request: Request, now: float) -> None:
        """``request`` finished (its status says why) at ``now`` (``time.monotonic()`` seconds)."""
        self.num_finished += 1
        self.request_success[request.status.value].inc()
        self.e2e.observe(now - request.arrival_time)
