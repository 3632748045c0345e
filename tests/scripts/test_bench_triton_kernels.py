"""bench_triton_kernels under Triton's interpreter: its cases run the engine's launchers on the tiny shape, a
sweep launches each combination of options it names and checks its result against the launch spec's."""

import math

import pytest
import torch

from loraplex_kernels.attention.paged_attention_triton import _paged_attention_kernel, row_launch
from loraplex_kernels.triton_launch import LaunchOptions, tuned_launch
from scripts.benchmarks.kernels.bench_triton_kernels import (
    QUICK_SHAPE,
    SWEEP_STAGES,
    SWEEP_WARPS,
    make_cases,
    sweep,
)

CPU = torch.device("cpu")


def test_cases_cover_attention_and_each_groups_shrink_and_expand():
    cases = make_cases(QUICK_SHAPE, torch.bfloat16, CPU, seed=0)
    assert [case.name for case in cases] == [
        "attention",
        *(f"sgmv_{op} {group}" for group in ("qkv", "gate_up", "down") for op in ("shrink", "expand")),
    ]
    for case in cases:
        first = case.result()
        case.call()  # a timed call in between (the expand adds into its output again)
        assert torch.equal(case.result(), first), case.name
        assert torch.isfinite(first.float()).all() and first.abs().sum() > 0, case.name
        assert case.bytes_moved > 0


def test_the_attention_case_moves_its_rows_keys_and_values():
    case = make_cases(QUICK_SHAPE, torch.float16, CPU, seed=1)[0]
    out = case.result()  # [rows, heads, head_dim]
    assert out.shape == (QUICK_SHAPE.rows, QUICK_SHAPE.heads, QUICK_SHAPE.head_dim)
    low, high = QUICK_SHAPE.context
    kv_per_key = 2 * QUICK_SHAPE.kv_heads * QUICK_SHAPE.head_dim * 2  # K and V, fp16
    assert QUICK_SHAPE.rows * low * kv_per_key < case.bytes_moved
    assert case.bytes_moved < QUICK_SHAPE.rows * high * kv_per_key + 3 * out.numel() * 2 + 4096


def test_sweep_times_every_combination_and_compares_results():
    case = make_cases(QUICK_SHAPE, torch.float32, CPU, seed=2)[1]  # the q/k/v shrink
    rows = sweep(case, CPU, repeats=1, bandwidth_gbs=100.0)
    assert [(row["num_warps"], row["num_stages"]) for row in rows] == [
        (warps, stages) for warps in SWEEP_WARPS for stages in SWEEP_STAGES
    ]
    assert all(row["max_diff"] == 0.0 and row["ms"] > 0 and math.isfinite(row["gbs"]) for row in rows)


def test_tuned_launch_sets_the_options_a_launcher_passes_for_the_block():
    launch = row_launch(torch.bfloat16, 4, 64, 16)
    assert launch.options() == {"num_warps": launch.num_warps}
    with tuned_launch(_paged_attention_kernel, LaunchOptions(8, 2)):
        assert launch.options() == {"num_warps": 8, "num_stages": 2}
        with tuned_launch(_paged_attention_kernel, LaunchOptions(2)):
            assert launch.options() == {"num_warps": 2}
        assert launch.options() == {"num_warps": 8, "num_stages": 2}
    assert launch.options() == {"num_warps": launch.num_warps}
    with pytest.raises(RuntimeError), tuned_launch(_paged_attention_kernel, LaunchOptions(8)):
        raise RuntimeError("a failed launch")
    assert launch.options() == {"num_warps": launch.num_warps}
