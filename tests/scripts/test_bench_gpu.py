"""bench_gpu --quick: the GPU workload's host share on the CPU, run as a user runs it (its last line is JSON)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_reports_the_host_step_with_and_without_adapters(tmp_path: Path) -> None:
    """With ``--launch-ahead on`` (the default on CUDA), so that the workloads run with passes launched ahead and
    again without."""
    options = [
        "--quick",
        "--json",
        "--skip-hf",
        "--output-len",
        "6",
        "--model-dir",
        str(tmp_path),
        "--launch-ahead",
        "on",
    ]
    completed = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.engine.bench_gpu", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["shape"] == "tiny" and result["device"] == "cpu" and result["rows"] == 256
    assert result["host_step_ms"] == result["step_ms_16"] > 0
    assert result["host_step_ms_base"] == result["step_ms_base"] > 0
    assert result["tok_s_base"] > 0 and result["tok_s_16"] > 0
    assert result["host_step_ratio"] == round(result["step_cpu_ms_16"] / result["step_cpu_ms_base"], 3)
    assert result["launch_ahead"] and result["tok_s_base_sync"] > 0 and result["tok_s_16_sync"] > 0
    assert result["ahead_taken_base"] > 0 and result["ahead_taken_16"] > 0 and "ahead_taken_16_sync" not in result
    assert (tmp_path / "tiny" / "config.json").is_file()  # the random model, written once where it was asked
