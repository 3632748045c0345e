"""The native bf16 pair panels (bf16 weights, k in pairs) on each of their GEMMs, vdpbf16ps and AMX tiles,
against a float64 reference on bf16-rounded activations: row counts on both sides of the tile sizes and of a
pass, odd in_features, partial last panels, bias, batch invariance, bad inputs; and where they cannot run,
that the engine keeps the widened panels (the AVX2 build runs this file too)."""

import os

import pytest
import torch

from engine.errors import ConfigError
from engine.modeling.bf16_gemm import resolve_bf16_gemm
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import MARCH_ENV, cpu_flags
from loraplex_kernels.projection.linear import DOT, WIDEN, LinearWeight, WeightLayout, linear
from loraplex_kernels.projection.linear_dot import (
    amx_available,
    dot_available,
    linear_amx,
    linear_dot,
    pack_linear_pairs,
)
from tests.kernels.scaled_error import assert_scaled_close

CPU = torch.device("cpu")
GEMMS = {"vdpbf16ps": (linear_dot, dot_available), "amx": (linear_amx, amx_available)}


@pytest.fixture(params=list(GEMMS))
def pair_gemm(request: pytest.FixtureRequest, native):
    """Each GEMM of the pair panels that runs here (the others skip): linear_dot, linear_amx."""
    gemm, available = GEMMS[request.param]
    if not available():
        pytest.skip(f"the pair panels' {request.param} GEMM needs a CPU that has it and the library built for it")
    return gemm


def reference(x: torch.Tensor, exact: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x rounded to bf16 (ties to even) @ exact.T + bias: [rows, out]."""
    y = x.bfloat16().double() @ exact.T
    return y if bias is None else y + bias.double()


def test_pair_panels_hold_k_in_pairs_and_zero_past_the_weight(native):
    width = native.linear_panel_width()
    weight = (torch.arange((width + 5) * 3) % 120).reshape(width + 5, 3).to(torch.bfloat16)  # [out, in=3]: odd k
    packed = pack_linear_pairs(weight)  # [2, 16, 2 * width]: k pairs to a whole AMX tile
    assert packed.shape == (2, 16, 2 * width) and packed.dtype == torch.bfloat16
    for out in range(width + 5):
        panel, column = packed[out // width], out % width
        assert torch.equal(panel[:, 2 * column : 2 * column + 2].reshape(-1)[:3], weight[out])
        assert panel[1, 2 * column + 1] == 0 and not panel[2:].any()  # k >= 3 is past in_features
    assert not packed[1, :, 10:].any()
    assert pack_linear_pairs(torch.ones(4, 64, dtype=torch.bfloat16)).shape == (1, 32, 2 * width)
    assert pack_linear_pairs(torch.ones(4, 65, dtype=torch.bfloat16)).shape == (1, 48, 2 * width)
    with pytest.raises(ValueError, match="bfloat16"):
        pack_linear_pairs(weight.float())
    with pytest.raises(ValueError, match="bfloat16"):
        pack_linear_pairs(weight.to(torch.int8))


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 33, 64, 129, 513])  # tiles of 8, 16; units of 32; passes
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (37, 50), (16, 1), (64, 80)])
def test_pair_panels_match_float64_on_bf16_rounded_inputs(
    pair_gemm, rows: int, in_features: int, out_features: int, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None  # [out], on odd row counts
    stored = weight.bfloat16()
    actual = pair_gemm(x, pack_linear_pairs(stored), bias, out_features)  # [rows, out]
    assert_scaled_close(actual, reference(x, stored.double(), bias), seed)


def test_a_rows_result_is_the_same_bits_in_any_batch(pair_gemm, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 577, generator=gen)  # [300, in]: odd in_features, passes of 128 and a partial one
    stored = (torch.randn(1000, 577, generator=gen) / 24).bfloat16()  # [out, in]
    bias = torch.randn(1000, generator=gen)
    packed = pack_linear_pairs(stored)
    alone = torch.cat([pair_gemm(x[i : i + 1], packed, bias, 1000) for i in (0, 5, 299)])  # [3, out]
    for batch in (x[:8], x[:9], x[:17], x[:64], x):  # one tile, a tile and a tail, several, passes
        together = pair_gemm(batch, packed, bias, 1000)  # [rows, out]
        assert torch.equal(together[0], alone[0]), f"seed={seed}"
        assert torch.equal(together[5], alone[1]), f"seed={seed}"
    assert torch.equal(pair_gemm(x, packed, bias, 1000)[299], alone[2]), f"seed={seed}"


def test_strided_rows(pair_gemm, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(70, 700, generator=gen)  # rows of 700 floats, of which 576 are x's
    weight = (torch.randn(960, 576, generator=gen) / 24).bfloat16()  # [out, in]
    packed = pack_linear_pairs(weight)
    for x in (wide[:, :576], wide[::3, 100:676]):
        assert_scaled_close(pair_gemm(x, packed, None, 960), reference(x, weight.double(), None), seed)
    bias, x = torch.randn(1920, generator=gen)[::2], wide[:, :576]  # a strided bias
    assert_scaled_close(pair_gemm(x, packed, bias, 960), reference(x, weight.double(), bias), seed)


def test_bad_inputs_are_refused(pair_gemm, native):
    packed = pack_linear_pairs(torch.randn(100, 64).bfloat16())
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        pair_gemm(x.double(), packed, None, 100)
    with pytest.raises(ValueError, match="x has 96 features, the weight takes 33 to 64"):
        pair_gemm(torch.randn(4, 96), packed, None, 100)
    with pytest.raises(ValueError, match="does not match"):
        pair_gemm(x, packed, None, 200)
    with pytest.raises(ValueError, match="pack_linear_pairs"):
        pair_gemm(x, native.pack_linear_weight(torch.randn(100, 64).bfloat16()), None, 100)
    with pytest.raises(ValueError, match="bias"):
        pair_gemm(x, packed, torch.randn(99), 100)


def test_linear_weight_takes_the_pair_panels_when_asked(native, seed: int):
    if not (dot_available() or amx_available()):
        pytest.skip("no GEMM of the pair panels runs here")
    gen = torch.Generator().manual_seed(seed)
    weight, bias = (torch.randn(200, 96, generator=gen) / 10).bfloat16(), torch.randn(200, generator=gen)
    x = torch.randn(33, 96, generator=gen)
    prepared = LinearWeight.prepare(weight, bias.bfloat16(), KernelBackend.NATIVE, None, DOT)
    layout = WeightLayout.NATIVE_AMX if amx_available() else WeightLayout.NATIVE_DOT  # AMX where it runs
    assert prepared.layout is layout and prepared.weight.dtype == torch.bfloat16
    assert_scaled_close(linear(x, prepared), reference(x, weight.double(), bias.bfloat16().float()), seed)


def test_the_pair_gemms_run_exactly_where_the_build_and_cpu_have_their_instructions(native):
    built_for_this_cpu = os.environ.get(MARCH_ENV) is None
    assert dot_available() == (built_for_this_cpu and "avx512_bf16" in cpu_flags().split())
    # AMX also needs Linux to grant the tile state, which kernels from 5.16 on do on a CPU that has it.
    assert amx_available() == (built_for_this_cpu and "amx_bf16" in cpu_flags().split())
    packed = pack_linear_pairs(torch.randn(100, 64).bfloat16())
    if not dot_available():
        with pytest.raises(ValueError, match="no AVX512-BF16 dot products here"):
            linear_dot(torch.randn(4, 64), packed, None, 100)
    if not amx_available():
        with pytest.raises(ValueError, match="no AMX tiles here"):
            linear_amx(torch.randn(4, 64), packed, None, 100)


def test_auto_keeps_the_widened_panels_where_the_dot_panels_cannot_run(native):
    if dot_available() or amx_available():
        pytest.skip("this build runs the dot-product panels (the AVX2 build's run of this file tests the rest)")
    choice = resolve_bf16_gemm("auto", "bfloat16", CPU, KernelBackend.NATIVE, (3072, 576), 64)
    assert choice is not None and choice.gemm == WIDEN
    assert choice.reason.startswith("bf16 GEMM widen") and "AVX512-BF16" in choice.reason
    with pytest.raises(ConfigError, match=r"bf16_gemm='dot' cannot be used.*AVX512-BF16"):
        resolve_bf16_gemm("dot", "bfloat16", CPU, KernelBackend.NATIVE, (3072, 576), 64)
