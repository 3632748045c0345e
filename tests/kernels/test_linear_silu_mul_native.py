"""The gated MLP's gate/up projection fused with SiLU x up (kernels/linear.py's linear_silu_mul): on AMX tiles
the same bits as the two ops, on every other layout the two ops themselves; bad inputs refused. The AVX2 build
runs this file too (no AMX there: the layouts' two ops)."""

import pytest
import torch

from kernels.backend import KernelBackend
from kernels.linear import DOT, WIDEN, LinearWeight, WeightLayout, linear, linear_silu_mul
from kernels.linear_dot import amx_available, dot_available, linear_amx, linear_amx_silu_mul, pack_linear_pairs
from kernels.silu_mul import silu_mul

NATIVE = KernelBackend.NATIVE
needs_amx = pytest.mark.skipif("not amx_available()", reason="the fused op runs on AMX tiles only")


def gate_up_weight(gen: torch.Generator, intermediate: int, in_features: int) -> torch.Tensor:
    """[2 * intermediate, in_features] bf16, gate's rows then up's."""
    return (torch.randn(2 * intermediate, in_features, generator=gen) / in_features**0.5).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 32, 33, 64, 513])  # tiles of 16, units of 32, passes of 512
@pytest.mark.parametrize(("in_features", "intermediate"), [(576, 1536), (37, 48), (64, 16)])
def test_fused_pass_is_the_same_bits_as_the_projection_then_silu_mul(
    native, rows: int, in_features: int, intermediate: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * 3  # [rows, in]: gates far into both tails of SiLU
    packed = pack_linear_pairs(gate_up_weight(gen, intermediate, in_features))
    fused = linear_amx_silu_mul(x, packed, intermediate)  # [rows, intermediate]
    two_ops = silu_mul(linear_amx(x, packed, None, 2 * intermediate), NATIVE)  # [rows, intermediate]
    assert fused.shape == (rows, intermediate) and fused.dtype == torch.float32
    assert torch.equal(fused, two_ops), f"seed={seed}"


def prepared_layouts(weight: torch.Tensor) -> dict[WeightLayout, LinearWeight]:
    """The weight in every native layout this CPU runs: the widened panels, and the pair panels' GEMM."""
    gemms = [WIDEN, DOT] if dot_available() or amx_available() else [WIDEN]
    prepared = [LinearWeight.prepare(weight, backend=NATIVE, bf16_gemm=gemm) for gemm in gemms]
    return {weight.layout: weight for weight in prepared}


@pytest.mark.parametrize("intermediate", [48, 40])  # 40: not whole AMX column blocks, so never fused
def test_linear_silu_mul_is_the_two_ops_on_every_layout(native, intermediate: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(70, 96, generator=gen)  # [rows, in]
    layouts = prepared_layouts(gate_up_weight(gen, intermediate, 96))
    assert WeightLayout.NATIVE in layouts
    for layout, prepared in layouts.items():
        expected = silu_mul(linear(x, prepared), NATIVE)  # [rows, intermediate]
        assert torch.equal(linear_silu_mul(x, prepared, NATIVE), expected), f"{layout} seed={seed}"


@needs_amx
def test_a_bias_runs_the_two_ops(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 64, generator=gen)  # [rows, in]
    bias = torch.randn(96, generator=gen)  # [2 * intermediate]
    prepared = LinearWeight.prepare(gate_up_weight(gen, 48, 64), bias, backend=NATIVE, bf16_gemm=DOT)
    expected = silu_mul(linear(x, prepared), NATIVE)
    assert torch.equal(linear_silu_mul(x, prepared, NATIVE), expected), f"seed={seed}"


@needs_amx
def test_bad_inputs_are_refused(native):
    packed = pack_linear_pairs(torch.ones(96, 64, dtype=torch.bfloat16))  # gate/up of intermediate 48
    x = torch.ones(3, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_amx_silu_mul(x, packed, 40)
    with pytest.raises(ValueError, match="out_features"):
        linear_amx_silu_mul(x, packed, 64)
    with pytest.raises(ValueError, match="features"):
        linear_amx_silu_mul(torch.ones(3, 65), packed, 48)
    with pytest.raises(ValueError, match="float32"):
        linear_amx_silu_mul(x.double(), packed, 48)


@pytest.mark.skipif("amx_available()", reason="checks the refusal where AMX cannot run")
def test_without_amx_the_fused_op_says_why(native):
    packed = pack_linear_pairs(torch.ones(96, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no AMX tiles"):
        linear_amx_silu_mul(torch.ones(3, 64), packed, 48)
