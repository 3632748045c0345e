"""What a load test records while it runs (requests, the server's memory) and the summary it reports."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from scripts.common.load_server import cpu_s, rss_mb
from scripts.common.percentiles import percentile
from scripts.common.sse_client import StreamResult

MAX_ERROR_SAMPLES = 5  # distinct error messages quoted in the summary; error_kinds counts them all


@dataclass(slots=True)
class Tally:
    """The load's requests as they end, and how many are in flight."""

    started: float
    """time.perf_counter() when the clients started."""
    results: list[StreamResult] = field(default_factory=list)
    endpoints: Counter[str] = field(default_factory=Counter)
    num_in_flight: int = 0
    drained_at: float | None = None
    """When the last request was read (or the drain gave up)."""

    def add(self, result: StreamResult, endpoint: str) -> None:
        self.results.append(result)
        self.endpoints[endpoint] += 1

    def num_errors(self) -> int:
        return sum(not r.ok for r in self.results)


@dataclass(slots=True)
class MemoryWatch:
    """The server's RSS and CPU time from ``baseline_at`` (a perf_counter time) to :meth:`finish`."""

    pid: int | None
    baseline_at: float
    start_mb: float | None = None
    end_mb: float | None = None
    max_mb: float | None = None
    trace_mb: list[float] = field(default_factory=list)
    server_cpu_start_s: float | None = None
    server_cpu_s: float | None = None
    client_cpu_start_s: float | None = None
    client_cpu_s: float | None = None

    def sample(self, now: float) -> float | None:
        """The RSS now; past the baseline it is also the start (the first time) and counts for the max."""
        rss = None if self.pid is None else rss_mb(self.pid)
        if now >= self.baseline_at:
            self._mark_start()
            if rss is not None:
                self.max_mb = max(self.max_mb or rss, rss)
        return rss

    def finish(self) -> None:
        self._mark_start()  # a run that ended before the baseline's first sample
        self.client_cpu_s = time.process_time() - self.client_cpu_start_s
        if self.pid is None:
            return
        self.end_mb, cpu_end = rss_mb(self.pid), cpu_s(self.pid)
        if self.end_mb is not None:
            self.max_mb = max(self.max_mb or self.end_mb, self.end_mb)
        if cpu_end is not None and self.server_cpu_start_s is not None:
            self.server_cpu_s = cpu_end - self.server_cpu_start_s

    def _mark_start(self) -> None:
        if self.client_cpu_start_s is not None:
            return
        self.client_cpu_start_s = time.process_time()
        if self.pid is not None:
            self.start_mb, self.server_cpu_start_s = rss_mb(self.pid), cpu_s(self.pid)


def percentile_ms(values: list[float], percent: float) -> float | None:
    """The percentile (``percentiles.py``) of ``values`` (seconds), in ms to 0.1; None for no values."""
    value = percentile(values, percent)
    return None if value is None else round(value * 1e3, 1)


def summarize(
    warmup: list[StreamResult], tally: Tally, memory: MemoryWatch, num_unfinished: int, end: float
) -> dict[str, object]:
    """The figures of a run; ``num_unfinished`` requests were still unread when the drain gave up (errors)."""
    results = tally.results
    failed = [r for r in [*warmup, *results] if not r.ok]
    kinds = Counter(r.error_kind for r in failed)
    if num_unfinished:
        kinds["unfinished"] += num_unfinished
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    drained_at = tally.drained_at or end
    wall_s = drained_at - tally.started
    return {
        "requests": len(results),
        "errors": sum(not r.ok for r in results) + num_unfinished,
        "ttft_p50_ms": percentile_ms(ttft, 50),
        "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(itl, 50),
        "itl_p99_ms": percentile_ms(itl, 99),
        "rss_growth_mb": _diff(memory.end_mb, memory.start_mb),
        "rss_start_mb": _round(memory.start_mb),
        "rss_end_mb": _round(memory.end_mb),
        "rss_max_mb": _round(memory.max_mb),
        "rss_trace_mb": memory.trace_mb,
        "warmup_requests": len(warmup),
        "warmup_errors": sum(not r.ok for r in warmup),
        "error_kinds": dict(kinds),
        "error_samples": list(dict.fromkeys(f"{r.error_kind}: {r.error_detail}" for r in failed))[:MAX_ERROR_SAMPLES],
        "requests_by_endpoint": dict(tally.endpoints),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "requests_per_s": round(len(results) / wall_s, 2) if wall_s > 0 else None,
        "drain_s": round(drained_at - end, 1),
        "server_cpu_s": _round(memory.server_cpu_s),
        "client_cpu_s": _round(memory.client_cpu_s),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else round(end - start, 1)
