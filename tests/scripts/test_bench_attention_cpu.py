"""bench_attention_cpu: its --kv step (the same values on fp32 and bf16 pages give the same outputs, the step with
every block on one page runs, and the read rates are the K/V bytes over the streamed step's time), and its
steps' third run, the native op on bf16 pages."""

import pytest

from scripts.benchmarks.kernels.bench_attention_cpu import (
    HEAD_DIM,
    KV_ROWS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    measure,
    measure_kv,
)
from tests.native_required import require_native_ops

CONTEXT = 64


def test_kv_step_reports_streamed_and_cached_times():
    require_native_ops()
    entry = measure_kv(CONTEXT, rounds=1, seed=0)
    assert entry["max_abs_diff"] == 0.0
    for name, value_bytes in (("fp32", 4), ("bf16", 2)):
        assert entry[f"{name}_kv_cached_ms"] > 0
        kv_bytes = KV_ROWS * CONTEXT * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * value_bytes
        rate_gb_s = kv_bytes / entry[f"{name}_kv_ms"] / 1e6  # reported to 0.1 GB/s: slow on a busy machine
        assert entry[f"{name}_kv_gb_s"] == pytest.approx(rate_gb_s, rel=0.05, abs=0.05)


def test_step_reports_the_native_op_on_bf16_pages():
    require_native_ops()
    entry = measure("prefill", rounds=1, seed=0)
    assert entry["native_bf16_ms"] > 0
    assert entry["bf16_speedup"] == pytest.approx(entry["native_ms"] / entry["native_bf16_ms"], rel=0.05)
