"""The native dot-product panels (bf16 weights, k in pairs, vdpbf16ps) against a float64 reference on
bf16-rounded activations: row counts on both sides of the tile size and of a pass, odd in_features, partial
last panels, bias, batch invariance, bad inputs; and where they cannot run, that the engine keeps the
widened panels (the AVX2 build runs this file too)."""

import os

import pytest
import torch

from engine.bf16_gemm import resolve_bf16_gemm
from engine.errors import ConfigError
from kernels.backend import KernelBackend
from kernels.linear import DOT, WIDEN, LinearWeight, WeightLayout, linear
from kernels.linear_dot import dot_available, linear_dot, pack_linear_pairs
from kernels.native_cpu import MARCH_ENV, cpu_flags
from tests.kernels.scaled_error import assert_scaled_close

CPU = torch.device("cpu")
needs_dot = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags().split() or os.environ.get(MARCH_ENV) is not None,
    reason="the dot-product panels need a CPU with avx512_bf16 and the library built for it",
)


def reference(x: torch.Tensor, exact: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x rounded to bf16 (ties to even) @ exact.T + bias: [rows, out]."""
    y = x.bfloat16().double() @ exact.T
    return y if bias is None else y + bias.double()


def test_pair_panels_hold_k_in_pairs_and_zero_past_the_weight(native):
    width = native.linear_panel_width()
    weight = (torch.arange((width + 5) * 3) % 120).reshape(width + 5, 3).to(torch.bfloat16)  # [out, in=3]: odd k
    packed = pack_linear_pairs(weight)  # [2, 2, 2 * width]
    assert packed.shape == (2, 2, 2 * width) and packed.dtype == torch.bfloat16
    for out in range(width + 5):
        panel, column = packed[out // width], out % width
        assert torch.equal(panel[:, 2 * column : 2 * column + 2].reshape(-1)[:3], weight[out])
        assert panel[1, 2 * column + 1] == 0  # k = 3 is past in_features
    assert not packed[1, :, 10:].any()
    with pytest.raises(ValueError, match="bfloat16"):
        pack_linear_pairs(weight.float())
    with pytest.raises(ValueError, match="bfloat16"):
        pack_linear_pairs(weight.to(torch.int8))


@needs_dot
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 129])  # tiles of 8, passes of 128
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (37, 50), (16, 1)])
def test_dot_panels_match_float64_on_bf16_rounded_inputs(
    native, rows: int, in_features: int, out_features: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None  # [out], on odd row counts
    stored = weight.bfloat16()
    actual = linear_dot(x, pack_linear_pairs(stored), bias, out_features)  # [rows, out]
    assert_scaled_close(actual, reference(x, stored.double(), bias), seed)


@needs_dot
def test_a_rows_result_is_the_same_bits_in_any_batch(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 577, generator=gen)  # [300, in]: odd in_features, passes of 128 and a partial one
    stored = (torch.randn(1000, 577, generator=gen) / 24).bfloat16()  # [out, in]
    bias = torch.randn(1000, generator=gen)
    packed = pack_linear_pairs(stored)
    alone = torch.cat([linear_dot(x[i : i + 1], packed, bias, 1000) for i in (0, 5, 299)])  # [3, out]
    for batch in (x[:8], x[:9], x[:64], x):  # one tile, a tile and a tail, several, passes
        together = linear_dot(batch, packed, bias, 1000)  # [rows, out]
        assert torch.equal(together[0], alone[0]), f"seed={seed}"
        assert torch.equal(together[5], alone[1]), f"seed={seed}"
    assert torch.equal(linear_dot(x, packed, bias, 1000)[299], alone[2]), f"seed={seed}"


@needs_dot
def test_strided_rows(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(70, 700, generator=gen)  # rows of 700 floats, of which 576 are x's
    weight = (torch.randn(960, 576, generator=gen) / 24).bfloat16()  # [out, in]
    packed = pack_linear_pairs(weight)
    for x in (wide[:, :576], wide[::3, 100:676]):
        assert_scaled_close(linear_dot(x, packed, None, 960), reference(x, weight.double(), None), seed)


@needs_dot
def test_bad_inputs_are_refused(native):
    packed = pack_linear_pairs(torch.randn(100, 64).bfloat16())
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        linear_dot(x.double(), packed, None, 100)
    with pytest.raises(ValueError, match="features"):
        linear_dot(torch.randn(4, 66), packed, None, 100)
    with pytest.raises(ValueError, match="does not match"):
        linear_dot(x, packed, None, 200)
    with pytest.raises(ValueError, match="pack_linear_pairs"):
        linear_dot(x, native.pack_linear_weight(torch.randn(100, 64).bfloat16()), None, 100)
    with pytest.raises(ValueError, match="bias"):
        linear_dot(x, packed, torch.randn(99), 100)


@needs_dot
def test_linear_weight_takes_the_dot_panels_when_asked(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = (torch.randn(200, 96, generator=gen) / 10).bfloat16(), torch.randn(200, generator=gen)
    x = torch.randn(33, 96, generator=gen)
    prepared = LinearWeight.prepare(weight, bias.bfloat16(), KernelBackend.NATIVE, None, DOT)
    assert prepared.layout is WeightLayout.NATIVE_DOT and prepared.weight.dtype == torch.bfloat16
    assert_scaled_close(linear(x, prepared), reference(x, weight.double(), bias.bfloat16().float()), seed)


def test_the_dot_panels_run_exactly_where_the_build_and_cpu_have_avx512_bf16(native):
    built_for_this_cpu = os.environ.get(MARCH_ENV) is None
    assert dot_available() == (built_for_this_cpu and "avx512_bf16" in cpu_flags().split())
    if not dot_available():
        packed = pack_linear_pairs(torch.randn(100, 64).bfloat16())
        with pytest.raises(ValueError, match="no AVX512-BF16 dot products here"):
            linear_dot(torch.randn(4, 64), packed, None, 100)


def test_auto_keeps_the_widened_panels_where_the_dot_panels_cannot_run(native):
    if dot_available():
        pytest.skip("this build runs the dot-product panels (the AVX2 build's run of this file tests the rest)")
    choice = resolve_bf16_gemm("auto", "bfloat16", CPU, KernelBackend.NATIVE, (3072, 576), 64)
    assert choice is not None and choice.gemm == WIDEN
    assert choice.reason.startswith("bf16 GEMM widen") and "AVX512-BF16" in choice.reason
    with pytest.raises(ConfigError, match=r"bf16_gemm='dot' cannot be used.*AVX512-BF16"):
        resolve_bf16_gemm("dot", "bfloat16", CPU, KernelBackend.NATIVE, (3072, 576), 64)
