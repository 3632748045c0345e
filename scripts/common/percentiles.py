"""The one percentile every benchmark and load test reports: nearest rank (docs/benchmarks-method.md).

The p-th percentile of n values is the value of rank ``ceil(p / 100 * n)`` in ascending order (rank 1 at
the least): a latency some request really had, never an interpolation between two, and never below the
share of requests it claims (at least p % of the values are at or under it). With fewer than 100 values,
p99 is the maximum.
"""

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], percent: float) -> float | None:
    """The nearest-rank ``percent``-th percentile of ``values`` (in their unit); None for no values."""
    if not 0 < percent <= 100:
        raise ValueError(f"a percentile is in (0, 100], got {percent}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(len(ordered) * percent / 100))
    return ordered[rank - 1]
