"""Prometheus metrics of the gateway and the engine, labelled by tenant and adapter.

Each app owns its registry (nothing global), so tests and several apps in one process never clash.
Engine gauges are read from the engine at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from app.latency_histogram import LatencyHistogram
from engine import EngineStats

BASE_ADAPTER_LABEL = "base"  # the adapter label of requests on the base model
# Seconds; TTFT on this CPU ranges from tens of milliseconds to tens of seconds under load.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The counters and histograms the request path updates, and the engine gauges /metrics reads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("tenant", "adapter")
        self.requests = Counter(
            "loraplex_requests",
            "Requests that reached the engine, by outcome.",
            (*labels, "endpoint", "status"),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        )
        self.completion_tokens = Counter(
            "loraplex_completion_tokens", "Generated tokens of finished requests.", labels, registry=self.registry
        )
        self.ttft = LatencyHistogram(
            "loraplex_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = LatencyHistogram(
            "loraplex_inter_token_latency_seconds",
            "Between two consecutive streamed outputs.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "loraplex_error_responses",
            "Requests answered with an error, by HTTP status and OpenAI error code (refused keys, oversized "
            "bodies, rate limits and server errors; a request that reached the engine also counts in requests).",
            ("status", "code"),
            registry=self.registry,
        )
        self.usage_pending = Gauge(
            "loraplex_usage_records_pending",
            "Usage records waiting to be written to PostgreSQL; grows while the database is away.",
            registry=self.registry,
        )
        self.queue_depth = Gauge("loraplex_queue_depth", "Sequences waiting for admission.", registry=self.registry)
        self.running = Gauge("loraplex_running_sequences", "Sequences in the running batch.", registry=self.registry)
        self.pool_pages = Gauge(
            "loraplex_pool_pages", "Pages of the unified pool by owner kind.", ("owner",), registry=self.registry
        )
        self.resident_adapters = Gauge(
            "loraplex_resident_adapters", "Adapters whose weights are in the pool.", registry=self.registry
        )

    def render(self, stats: EngineStats | None, usage_pending: int) -> bytes:
        """The exposition text, with the engine gauges set from ``stats`` (None: engine not started)."""
        self.usage_pending.set(usage_pending)
        if stats is not None:
            self.queue_depth.set(stats.num_waiting)
            self.running.set(stats.num_running)
            self.resident_adapters.set(stats.num_resident_adapters)
            for owner, num_pages in stats.pages_by_owner.items():
                self.pool_pages.labels(owner=owner).set(num_pages)
        return generate_latest(self.registry)
