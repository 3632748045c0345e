"""The light histogram exposes exactly what prometheus_client's Histogram would for the same observations."""

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from app.observability.latency_histogram import LatencyHistogram

BUCKETS = (0.005, 0.01, 0.5, 1.0)


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_exposition_matches_prometheus_client_including_values_on_bucket_bounds() -> None:
    reference_registry, registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("lat_seconds", "doc", ("tenant", "adapter"), buckets=BUCKETS, registry=reference_registry)
    light = LatencyHistogram("lat_seconds", "doc", ("tenant", "adapter"), buckets=BUCKETS, registry=registry)
    chooser = random.Random(3)
    for _ in range(500):
        labels = (chooser.choice(["acme", "globex"]), chooser.choice(["base", "alpha"]))
        value = chooser.choice([0.0, 0.003, 0.005, 0.01, 0.2, 1.0, 7.5])  # bounds themselves belong to their bucket
        reference.labels(*labels).observe(value)
        light.labels(*labels).observe(value)
    assert _without_created(generate_latest(registry)) == _without_created(generate_latest(reference_registry))


def test_wrong_label_count_and_unsorted_buckets_are_refused() -> None:
    light = LatencyHistogram("lat_seconds", "doc", ("tenant",), buckets=BUCKETS, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="takes labels"):
        light.labels("acme", "extra")
    with pytest.raises(ValueError, match="ascending"):
        LatencyHistogram("other_seconds", "doc", ("tenant",), buckets=(1.0, 0.5), registry=CollectorRegistry())
