"""A short run of scripts/benchmarks/gateway/load_test.py on the real server and default model: no errors, every figure
reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.default_model

ROOT = Path(__file__).resolve().parents[2]
NUM_CLIENTS = 4
NUM_TENANTS = 2
ADAPTERS_PER_TENANT = 1
REPORTED = ("requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "rss_growth_mb")


def test_short_load_run_streams_every_request_to_done_without_errors() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.benchmarks.gateway.load_test",
            "--clients",
            str(NUM_CLIENTS),
            "--duration",
            "3",
            "--rss-baseline-after",
            "1",
            "--tenants",
            str(NUM_TENANTS),
            "--adapters-per-tenant",
            str(ADAPTERS_PER_TENANT),
            "--max-tokens",
            "4",
            "--pool-mb",
            "256",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )

    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert all(report[key] is not None for key in REPORTED), report
    assert report["errors"] == 0 and report["warmup_errors"] == 0, report["error_samples"]
    # Every (tenant, model) pair was called once before the clock started: each tenant's base model and adapters.
    assert report["warmup_requests"] >= NUM_TENANTS * (1 + ADAPTERS_PER_TENANT)
    assert report["requests"] > 0
    assert report["completion_tokens"] > 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    assert 0 < report["itl_p50_ms"] <= report["itl_p99_ms"]
    assert report["rss_start_mb"] > 0 and report["rss_end_mb"] > 0
    assert report["server_stopped_cleanly"], report["server_exit_code"]
