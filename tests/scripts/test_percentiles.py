"""One percentile for every benchmark: nearest rank, and the scripts that report p50/p99 agree on it."""

import importlib
import random

import pytest


@pytest.fixture(scope="module")
def scripts() -> dict[str, object]:
    """The percentile module and the scripts that report percentiles, by their names."""
    modules = (
        "common.percentiles",
        "benchmarks.gateway.bench_gateway",
        "benchmarks.gateway.load_stats",
        "benchmarks.gateway.bench_ray",
    )
    return {name.split(".")[-1]: importlib.import_module(f"scripts.{name}") for name in modules}


@pytest.mark.parametrize(
    ("values", "percent", "expected"),
    [
        ([3.0, 1.0, 2.0, 4.0], 50, 2.0),  # rank ceil(2.0) = 2: the lower middle, not 2.5
        ([float(v) for v in range(1, 11)], 90, 9.0),  # rank 9, not 9.1
        ([float(v) for v in range(1, 11)], 99, 10.0),  # fewer than 100 values: p99 is the maximum
        ([float(v) for v in range(1, 201)], 99, 198.0),  # rank ceil(198.0) = 198
        ([float(v) for v in range(1, 202)], 99, 199.0),  # rank ceil(198.99) = 199
        ([5.0], 50, 5.0),
        ([], 50, None),
    ],
)
def test_nearest_rank(scripts: dict[str, object], values: list[float], percent: float, expected: float | None) -> None:
    assert scripts["percentiles"].percentile(values, percent) == expected


@pytest.mark.parametrize("percent", [0, -1, 101])
def test_a_percent_out_of_range_is_refused(scripts: dict[str, object], percent: float) -> None:
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        scripts["percentiles"].percentile([1.0, 2.0], percent)


@pytest.mark.parametrize("num_values", [4, 10, 57, 150])
def test_the_benchmarks_report_the_same_p50_and_p99_of_the_same_latencies(
    scripts: dict[str, object], num_values: int
) -> None:
    latencies_s = [random.Random(num_values).lognormvariate(-5, 1) for _ in range(num_values)]
    phase = scripts["bench_gateway"].PhaseResult("chat", latencies_s, num_values, 0, 1.0, 0.0, 0.0)
    for percent in (50, 99):
        expected_ms = scripts["percentiles"].percentile(latencies_s, percent) * 1000.0
        assert phase.percentile_ms(percent) == pytest.approx(expected_ms)
        assert scripts["load_stats"].percentile_ms(latencies_s, percent) == round(expected_ms, 1)
        latencies_ms = [value * 1000.0 for value in latencies_s]
        assert scripts["bench_ray"].percentile(latencies_ms, percent) == pytest.approx(expected_ms)
