"""Time to first token per tenant and adapter since this gateway started, read from its metrics histogram.

The quantiles are estimated from the histogram's buckets as Prometheus' ``histogram_quantile`` does:
linear within the bucket that holds the rank, so each is as fine as the bucket bounds (TTFT_BUCKETS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.observability.metrics import GatewayMetrics


@dataclass(frozen=True, slots=True)
class LatencyLine:
    tenant: str
    adapter: str
    requests: int
    mean_ms: float
    p50_ms: float
    p95_ms: float


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q`` quantile from cumulative (upper bound, count) buckets, the last bound +Inf."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the last finite bound: that bound is all a histogram can say
            width = count - lower_count
            return bound if width == 0 else lower_bound + (bound - lower_bound) * (rank - lower_count) / width
        lower_bound, lower_count = bound, count
    return lower_bound


def ttft_lines(metrics: GatewayMetrics) -> list[LatencyLine]:
    """One line per tenant and adapter that has finished a request on this gateway, by tenant then adapter."""
    lines = []
    for family in metrics.ttft.collect():
        by_labels: dict[tuple[str, str], dict[str, object]] = {}
        for sample in family.samples:
            labels = (sample.labels["tenant"], sample.labels["adapter"])
            entry = by_labels.setdefault(labels, {"buckets": []})
            if sample.name.endswith("_bucket"):
                entry["buckets"].append((float(sample.labels["le"]), sample.value))  # type: ignore[union-attr]
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
        for (tenant, adapter), entry in by_labels.items():
            buckets: list[tuple[float, float]] = entry["buckets"]  # type: ignore[assignment]
            count = buckets[-1][1] if buckets else 0
            if not count:
                continue
            lines.append(
                LatencyLine(
                    tenant=tenant,
                    adapter=adapter,
                    requests=int(count),
                    mean_ms=1000 * float(entry.get("sum", 0.0)) / count,  # type: ignore[arg-type]
                    p50_ms=1000 * bucket_quantile(0.5, buckets),
                    p95_ms=1000 * bucket_quantile(0.95, buckets),
                )
            )
    return sorted(lines, key=lambda line: (line.tenant, line.adapter))
