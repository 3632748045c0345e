"""The gated MLP's gate/up projection fused with SiLU x up: on every native GEMM that runs here (k-major
panels of fp32, bf16 and int8 weights; bf16 pair panels on vdpbf16ps and on AMX tiles) the same bits as the
projection followed by silu_mul; loraplex_kernels/projection/linear.py's linear_silu_mul takes the fused pass where the
layout has one and the two ops elsewhere; bad inputs refused. The AVX2 build runs this file too (panels of 24
columns there, no dot products)."""

from collections.abc import Callable

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.silu_mul import silu_mul
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, linear, linear_silu_mul, quantize_int8
from loraplex_kernels.projection.linear_dot import (
    amx_available,
    dot_available,
    linear_amx,
    linear_amx_silu_mul,
    linear_dot,
    linear_dot_silu_mul,
    pack_linear_pairs,
)
from loraplex_kernels.projection.linear_packed import linear_packed, linear_packed_silu_mul, pack_linear_weight
from loraplex_kernels.projection.linear_vnni import vnni_available

NATIVE = KernelBackend.NATIVE
Product = Callable[[torch.Tensor], torch.Tensor]  # x -> [rows, 2 * intermediate] or [rows, intermediate]


def gate_up_weight(gen: torch.Generator, intermediate: int, in_features: int) -> torch.Tensor:
    """[2 * intermediate, in_features] fp32, gate's rows then up's."""
    return torch.randn(2 * intermediate, in_features, generator=gen) / in_features**0.5


def pair_ops(weight: torch.Tensor, intermediate: int, gemm, fused) -> tuple[Product, Product]:
    packed = pack_linear_pairs(weight.bfloat16())
    return (lambda x: gemm(x, packed, None, 2 * intermediate)), (lambda x: fused(x, packed, intermediate))


def panel_ops(weight: torch.Tensor, intermediate: int, dtype: torch.dtype) -> tuple[Product, Product]:
    scales = None
    if dtype == torch.int8:
        weight, scales = quantize_int8(weight)  # [2 * intermediate, in] int8, [2 * intermediate]
    packed = pack_linear_weight(weight.to(dtype))
    return (
        lambda x: linear_packed(x, packed, None, 2 * intermediate, scales),
        lambda x: linear_packed_silu_mul(x, packed, intermediate, scales),
    )


FUSED = {  # name: (runs here, (weight, intermediate) -> (projection, fused pass))
    "panels_fp32": (lambda: True, lambda w, i: panel_ops(w, i, torch.float32)),
    "panels_bf16": (lambda: True, lambda w, i: panel_ops(w, i, torch.bfloat16)),
    "panels_int8": (lambda: True, lambda w, i: panel_ops(w, i, torch.int8)),
    "vdpbf16ps": (dot_available, lambda w, i: pair_ops(w, i, linear_dot, linear_dot_silu_mul)),
    "amx": (amx_available, lambda w, i: pair_ops(w, i, linear_amx, linear_amx_silu_mul)),
}


@pytest.fixture(params=list(FUSED))
def fused_gemm(request: pytest.FixtureRequest, native):
    """Each GEMM's fused gate/up pass that runs here (the others skip)."""
    available, make = FUSED[request.param]
    if not available():
        pytest.skip(f"the {request.param} GEMM needs a CPU that has it and the library built for it")
    return make


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 33, 64, 129, 513])  # tiles, units, passes of 128 and 512
@pytest.mark.parametrize(("in_features", "intermediate"), [(576, 1536), (37, 48), (64, 96)])
def test_fused_pass_is_the_same_bits_as_the_projection_then_silu_mul(
    fused_gemm, rows: int, in_features: int, intermediate: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * 3  # [rows, in]: gates far into both tails of SiLU
    projection, fused = fused_gemm(gate_up_weight(gen, intermediate, in_features), intermediate)
    act = fused(x)  # [rows, intermediate]
    assert act.shape == (rows, intermediate) and act.dtype == torch.float32
    assert torch.equal(act, silu_mul(projection(x), NATIVE)), f"seed={seed}"


def prepared_layouts(weight: torch.Tensor, quantization: str | None) -> list[LinearWeight]:
    """The weight in every native layout this CPU runs for its format: widened panels and the dot GEMM."""
    dot_runs = vnni_available() if quantization == "int8" else dot_available() or amx_available()
    gemms = [WIDEN, DOT] if dot_runs else [WIDEN]
    return [LinearWeight.prepare(weight, backend=NATIVE, quantization=quantization, bf16_gemm=g) for g in gemms]


@pytest.mark.parametrize("intermediate", [48, 40])  # 40: not whole panels, so never fused
@pytest.mark.parametrize(("dtype", "quantization"), [(torch.float32, None), (torch.bfloat16, None), (None, "int8")])
def test_linear_silu_mul_is_the_two_ops_on_every_layout(
    native, dtype: torch.dtype | None, quantization: str | None, intermediate: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(70, 96, generator=gen)  # [rows, in]
    weight = gate_up_weight(gen, intermediate, 96).to(dtype or torch.bfloat16)
    for prepared in prepared_layouts(weight, quantization):
        expected = silu_mul(linear(x, prepared), NATIVE)  # [rows, intermediate]
        assert torch.equal(linear_silu_mul(x, prepared, NATIVE), expected), f"{prepared.layout} seed={seed}"


def test_a_bias_runs_the_two_ops(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 64, generator=gen)  # [rows, in]
    bias = torch.randn(96, generator=gen)  # [2 * intermediate]
    prepared = LinearWeight.prepare(gate_up_weight(gen, 48, 64).bfloat16(), bias, backend=NATIVE)
    assert torch.equal(linear_silu_mul(x, prepared, NATIVE), silu_mul(linear(x, prepared), NATIVE)), f"seed={seed}"


def test_bad_inputs_are_refused(fused_gemm):
    _, fused = fused_gemm(torch.ones(96, 64), 48)  # gate/up of intermediate 48
    assert fused(torch.ones(3, 64)).shape == (3, 48)
    with pytest.raises(ValueError, match="features"):
        fused(torch.ones(3, 65))
    with pytest.raises(ValueError, match="float32"):
        fused(torch.ones(3, 64, dtype=torch.float64))


@pytest.mark.parametrize("op", ["panels", "vdpbf16ps", "amx"])
def test_an_intermediate_of_partial_blocks_or_a_mismatch_is_refused(native, op: str):
    if op == "panels":
        packed, fused = pack_linear_weight(torch.ones(96, 64)), linear_packed_silu_mul
    else:
        available = dot_available if op == "vdpbf16ps" else amx_available
        if not available():
            pytest.skip(f"{op} does not run here")
        packed = pack_linear_pairs(torch.ones(96, 64, dtype=torch.bfloat16))
        fused = linear_dot_silu_mul if op == "vdpbf16ps" else linear_amx_silu_mul
    x = torch.ones(3, 64)
    with pytest.raises(ValueError, match="multiple of"):
        fused(x, packed, 40)
    with pytest.raises(ValueError, match="out_features"):
        fused(x, packed, 96)


@pytest.mark.skipif("amx_available() and dot_available()", reason="checks the refusals where a GEMM cannot run")
def test_without_the_instructions_the_fused_passes_say_why(native):
    packed = pack_linear_pairs(torch.ones(96, 64, dtype=torch.bfloat16))
    if not amx_available():
        with pytest.raises(ValueError, match="no AMX tiles"):
            linear_amx_silu_mul(torch.ones(3, 64), packed, 48)
    if not dot_available():
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            linear_dot_silu_mul(torch.ones(3, 64), packed, 48)
