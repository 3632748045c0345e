"""A labelled Prometheus histogram cheap enough to observe once per generated token.

prometheus_client's Histogram takes a lock and increments a value object per bucket on every
observation (docs/benchmarks.md#gateway-constants-and-choices), and the inter-token histogram gets one per
token of every request. Here an observation is a bisect and two additions. No lock: observations and
scrapes all run on the app's event loop.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class HistogramSeries:
    """One label set's bucket counts (not cumulative) and sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # buckets hold values <= their bound
        self.sum += value


class LatencyHistogram:
    """Registered in ``registry`` like a prometheus_client Histogram; ``labels(...)`` gives a series to observe."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        if list(buckets) != sorted(buckets) or not buckets or math.isinf(buckets[-1]):
            raise ValueError(f"buckets must be finite and ascending, got {buckets!r}")
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(float(bound) for bound in buckets)
        self._series: dict[tuple[str, ...], HistogramSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramSeries:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values!r}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = HistogramSeries(self._bounds)
        return series

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        bounds = [floatToGoString(bound) for bound in self._bounds] + ["+Inf"]
        for values, series in self._series.items():
            cumulative = itertools.accumulate(series.counts)
            family.add_metric(list(values), list(zip(bounds, cumulative, strict=True)), series.sum)
        yield family
