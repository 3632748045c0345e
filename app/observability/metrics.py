"""Prometheus metrics of the gateway and the engine, labelled by tenant and adapter.

Each app owns its registry (nothing global), so tests and several apps in one process never clash.
Engine gauges are read from the engine at scrape time, one series per engine worker (label ``worker``).
Next to our own, each worker exports the gauges a Kubernetes router reads for LoRA-affine routing (the
Gateway API Inference Extension's endpoint picker, llm-d), named and labelled as vLLM exports them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from app.observability.latency_histogram import LatencyHistogram
from engine import EngineStats

BASE_ADAPTER_LABEL = "base"  # the adapter label of requests on the base model
WORKER = "worker"  # the label of engine gauges: the engine worker's id
KV_OWNER = "kv"  # pages_by_owner's key of pages holding running sequences' KV (OwnerKind.KV)
# vLLM's label names of vllm:lora_requests_info, which routers parse.
MAX_LORA = "max_lora"
WAITING_LORA_ADAPTERS = "waiting_lora_adapters"
RUNNING_LORA_ADAPTERS = "running_lora_adapters"
ADAPTER_SEPARATOR = ","  # between the adapter names of one lora_requests_info label, as vLLM joins them
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
        self.limit_backend_errors = Counter(
            "loraplex_limit_backend_errors",
            "Limit checks and updates that Redis did not answer, by kind of limit (rate, concurrency, budget) and "
            "outcome (open: let in unchecked; closed: refused with a 503; lost: a settle or lease renewal not taken).",
            ("limit", "outcome"),
            registry=self.registry,
        )
        self.usage_pending = Gauge(
            "loraplex_usage_records_pending",
            "Usage records waiting to be written to PostgreSQL; grows while the database is away.",
            registry=self.registry,
        )
        self.usage_spool_bytes = Gauge(
            "loraplex_usage_spool_bytes",
            "Bytes of usage records in the local spool that PostgreSQL does not hold yet; at "
            "LORAPLEX_USAGE_SPOOL_MAX_MB new requests are refused.",
            registry=self.registry,
        )
        self.workers = WorkerGauges(self.registry)

    def render(
        self, stats_by_worker: dict[str, EngineStats] | None, usage_pending: int, usage_spool_bytes: int = 0
    ) -> bytes:
        """The exposition text, with the engine gauges set from each worker's stats (None: engine not started)."""
        self.usage_pending.set(usage_pending)
        self.usage_spool_bytes.set(usage_spool_bytes)
        self.workers.clear()
        for worker, stats in (stats_by_worker or {}).items():
            self.workers.set(worker, stats)
        return generate_latest(self.registry)


class WorkerGauges:
    """The engine gauges, one series per engine worker, set from its stats at each scrape.

    They are cleared before each scrape sets them again, so a worker that went away leaves no series
    behind, and ``vllm:lora_requests_info`` holds one series per worker: its current label set.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        worker = (WORKER,)
        self.queue_depth = Gauge("loraplex_queue_depth", "Sequences waiting for admission.", worker, registry=registry)
        self.running = Gauge("loraplex_running_sequences", "Sequences in the running batch.", worker, registry=registry)
        self.pool_pages = Gauge(
            "loraplex_pool_pages", "Pages of the unified pool by owner kind.", (WORKER, "owner"), registry=registry
        )
        self.resident_adapters = Gauge(
            "loraplex_resident_adapters", "Adapters whose weights are in the pool.", worker, registry=registry
        )
        self.registered_adapters = Gauge(
            "loraplex_registered_adapters",
            "Adapters registered in the engine (validated, in host memory), whether in the pool or not.",
            worker,
            registry=registry,
        )
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", worker, registry=registry
        )
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Number of requests currently running.", worker, registry=registry
        )
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: the fraction of the pool's pages holding running sequences' KV (0 to 1).",
            worker,
            registry=registry,
        )
        self.vllm_lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests: the unix time (seconds) of the last update, the adapters in labels.",
            (WORKER, MAX_LORA, WAITING_LORA_ADAPTERS, RUNNING_LORA_ADAPTERS),
            registry=registry,
        )
        self.precision_info = Gauge(
            "loraplex_precision_info",
            "1, with the engine's precision in labels: model dtype, activation, K/V and weight formats, and why.",
            (WORKER, "dtype", "activations", "kv", "weights", "reason"),
            registry=registry,
        )
        self.proposed_tokens = Gauge(
            "loraplex_speculative_proposed_tokens",
            "Tokens proposed by n-gram speculative decoding since the engine started, by adapter (empty: the base).",
            (WORKER, "adapter"),
            registry=registry,
        )
        self.accepted_tokens = Gauge(
            "loraplex_speculative_accepted_tokens",
            "Proposed tokens that verification accepted since the engine started, by adapter (empty: the base).",
            (WORKER, "adapter"),
            registry=registry,
        )
        self.acceptance_rate = Gauge(
            "loraplex_speculative_acceptance_rate",
            "Accepted over proposed speculative tokens since the engine started (0 before any proposal).",
            worker,
            registry=registry,
        )
        self._gauges = (
            self.precision_info,
            self.queue_depth,
            self.running,
            self.pool_pages,
            self.resident_adapters,
            self.registered_adapters,
            self.vllm_waiting,
            self.vllm_running,
            self.vllm_kv_usage,
            self.vllm_lora_info,
            self.proposed_tokens,
            self.accepted_tokens,
            self.acceptance_rate,
        )

    def clear(self) -> None:
        """Forget every worker's series."""
        for gauge in self._gauges:
            gauge.clear()

    def set(self, worker: str, stats: EngineStats) -> None:
        """Set ``worker``'s series from its stats."""
        self.queue_depth.labels(worker).set(stats.num_waiting)
        self.running.labels(worker).set(stats.num_running)
        self.resident_adapters.labels(worker).set(stats.num_resident_adapters)
        self.registered_adapters.labels(worker).set(stats.num_registered_adapters)
        for owner, num_pages in stats.pages_by_owner.items():
            self.pool_pages.labels(worker, owner).set(num_pages)
        self.vllm_waiting.labels(worker).set(stats.num_waiting)
        self.vllm_running.labels(worker).set(stats.num_running)
        self.vllm_kv_usage.labels(worker).set(kv_usage(stats))
        self.precision_info.labels(
            worker, stats.dtype, stats.activation_dtype, stats.kv_dtype, stats.weight_format, stats.precision_reason
        ).set(1)
        for adapter, num_tokens in stats.num_proposed_tokens.items():
            self.proposed_tokens.labels(worker, adapter).set(num_tokens)
            self.accepted_tokens.labels(worker, adapter).set(stats.num_accepted_tokens.get(adapter, 0))
        self.acceptance_rate.labels(worker).set(stats.acceptance_rate)
        self.vllm_lora_info.labels(
            worker,
            str(stats.max_adapters),
            ADAPTER_SEPARATOR.join(stats.waiting_adapters),
            ADAPTER_SEPARATOR.join(stats.running_adapters),
        ).set_to_current_time()


def kv_usage(stats: EngineStats) -> float:
    """The fraction (0 to 1) of the pool's pages that hold running sequences' KV, as vLLM's kv_cache_usage_perc.

    Pages of adapters and of the prefix cache (reclaimable) are not counted as used, as vLLM counts its
    cached free blocks as free.
    """
    if stats.num_pages == 0:
        return 0.0
    return stats.pages_by_owner.get(KV_OWNER, 0) / stats.num_pages
