"""The native panel GEMM against F.linear: the packed layout, row counts on both sides of the tile size and
of a pass, widths with and without a partial last panel, bias, strided rows, batch invariance, and bad
inputs; and LinearWeight choosing it."""

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import AVX2_MARCH, MARCH_ENV, cpu_flags
from loraplex_kernels.projection.linear import LinearWeight, WeightLayout, linear, quantize_int8
from loraplex_kernels.projection.linear_packed import linear_packed, native_linear_preferred, pack_linear_weight
from tests.kernels.scaled_error import assert_scaled_close
from tests.kernels.threads import torch_threads


def test_packed_layout_holds_each_panel_k_major_and_zero_past_the_weight(native):
    width = native.linear_panel_width()
    weight = torch.arange(float((width + 5) * 3)).reshape(width + 5, 3)  # [out, in]: one panel and 5 columns
    packed = pack_linear_weight(weight)  # [2, 3, width]
    assert packed.shape == (2, 3, width)
    for out in range(width + 5):
        assert torch.equal(packed[out // width, :, out % width], weight[out])
    assert not packed[1, :, 5:].any()


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 129, 700])  # tiles of 8 (4 on AVX2), passes of 128
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (37, 50), (16, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(native, rows: int, in_features: int, out_features: int, with_bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
    bias = torch.randn(out_features, generator=gen) if with_bias else None  # [out]
    actual = linear_packed(x, pack_linear_weight(weight), bias, out_features)  # [rows, out]
    assert_scaled_close(actual, F.linear(x, weight, bias), seed)


def test_strided_rows(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(70, 700, generator=gen)  # rows of 700 floats, of which the first 576 are x's
    weight = torch.randn(960, 576, generator=gen) / 24  # [out, in]
    packed = pack_linear_weight(weight)
    for x in (wide[:, :576], wide[::3, 100:676]):
        assert_scaled_close(linear_packed(x, packed, None, 960), F.linear(x, weight), seed)


def test_a_rows_result_is_the_same_bits_in_any_batch(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(700, 576, generator=gen)  # [700, in]: passes of 128 and a partial one
    weight = torch.randn(3072, 576, generator=gen) / 24  # [out, in]
    bias = torch.randn(3072, generator=gen)
    packed = pack_linear_weight(weight)
    alone = torch.cat([linear_packed(x[i : i + 1], packed, bias, 3072) for i in (0, 5, 699)])  # [3, out]
    for batch in (x[:64], x[:9], x):
        together = linear_packed(batch, packed, bias, 3072)  # [rows, out]
        assert torch.equal(together[0], alone[0]), f"seed={seed}"
        if len(batch) > 5:
            assert torch.equal(together[5], alone[1]), f"seed={seed}"
    assert torch.equal(linear_packed(x, packed, bias, 3072)[699], alone[2]), f"seed={seed}"


@pytest.mark.parametrize("weight_format", ["float32", "bfloat16", "int8"])
def test_the_same_bits_on_any_number_of_threads(native, weight_format: str, seed: int):
    # Each thread count splits the panels differently (5 threads on fewer cores also preempt each other);
    # a panel run twice or never, or a sum that depended on the split, would show as a difference.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(70, 576, generator=gen)  # [rows, in]
    weight = torch.randn(3072, 576, generator=gen) / 24  # [out, in]: 64 panels of 48 (128 of 24 on AVX2)
    scales = None
    if weight_format == "int8":
        weight, scales = quantize_int8(weight)
    packed = pack_linear_weight(weight.to(torch.bfloat16) if weight_format == "bfloat16" else weight)
    bias = torch.randn(3072, generator=gen)
    with torch_threads(1):
        expected = linear_packed(x, packed, bias, 3072, scales)  # [rows, out]
    for num_threads in (2, 3, 5):
        with torch_threads(num_threads):
            for _ in range(5):
                assert torch.equal(linear_packed(x, packed, bias, 3072, scales), expected), f"seed={seed}"


def test_bad_inputs_are_refused(native):
    weight = torch.randn(100, 64)  # [out, in]
    packed = pack_linear_weight(weight)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        linear_packed(x.double(), packed, None, 100)
    with pytest.raises(ValueError, match="contiguous rows"):
        linear_packed(torch.randn(64, 4).T, packed, None, 100)
    with pytest.raises(ValueError, match="features"):
        linear_packed(torch.randn(4, 65), packed, None, 100)
    with pytest.raises(ValueError, match="does not match"):
        linear_packed(x, packed, None, 200)
    with pytest.raises(ValueError, match="bias"):
        linear_packed(x, packed, torch.randn(99), 100)
    with pytest.raises(ValueError, match="pack_linear_weight"):
        linear_packed(x, torch.randn(2, 64, 7), None, 10)
    with pytest.raises(ValueError, match="float32"):
        pack_linear_weight(weight.double())


def test_linear_weight_takes_the_native_panels_where_preferred(native, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(33, 96, generator=gen)
    native_weight = LinearWeight.prepare(weight, bias, KernelBackend.NATIVE)
    torch_weight = LinearWeight.prepare(weight, bias, KernelBackend.TORCH)
    if platform.machine() in ("x86_64", "AMD64"):  # the wide panels iff the build has AVX-512
        march = os.environ.get(MARCH_ENV)  # another target than this CPU's (the AVX2 build's test sets haswell)
        built_wide = "avx512f" in cpu_flags().split() if march is None else march != AVX2_MARCH
        assert native_linear_preferred() == built_wide
    expected_layout = WeightLayout.NATIVE if native_linear_preferred() else WeightLayout.ONEDNN
    assert native_weight.layout is expected_layout
    assert torch_weight.layout is not WeightLayout.NATIVE
    for prepared in (native_weight, torch_weight):
        assert_scaled_close(linear(x, prepared), F.linear(x, weight, bias), seed)


@pytest.mark.parametrize("rows", [1, 9, 129])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (37, 50)])
@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
def test_bf16_and_int8_panels_match_f_linear_on_their_weights(
    native, rows: int, in_features: int, out_features: int, weight_format: str, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
    bias = torch.randn(out_features, generator=gen)  # [out]
    if weight_format == "int8":
        q, scales = quantize_int8(weight)  # [out, in] int8, [out]
        packed, exact = pack_linear_weight(q), q.float() * scales[:, None]  # the weight the panels hold
    else:
        scales, packed, exact = None, pack_linear_weight(weight.bfloat16()), weight.bfloat16().float()
    assert packed.dtype == (torch.int8 if weight_format == "int8" else torch.bfloat16)
    actual = linear_packed(x, packed, bias, out_features, scales)  # [rows, out]
    assert_scaled_close(actual, F.linear(x, exact, bias), seed)


def test_int8_quantization_is_symmetric_per_row_and_close():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]])  # [3, 3], a zero row
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert torch.equal(q[1], torch.zeros(3, dtype=torch.int8))
    assert torch.allclose(scales, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))
    assert (q.float() * scales[:, None] - weight).abs().max() <= scales.max() / 2


def test_int8_panels_refuse_missing_or_stray_scales(native):
    q, scales = quantize_int8(torch.randn(100, 64))
    packed_int8, packed_fp32 = pack_linear_weight(q), pack_linear_weight(torch.randn(100, 64))
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="scales"):
        linear_packed(x, packed_int8, None, 100)
    with pytest.raises(ValueError, match="scales"):
        linear_packed(x, packed_fp32, None, 100, scales)
    with pytest.raises(ValueError, match="scales"):
        linear_packed(x, packed_int8, None, 100, scales[:99])


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
def test_linear_weight_takes_native_panels_for_bf16_and_int8_on_any_build(native, weight_format: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(200, 96, generator=gen) / 10, torch.randn(200, generator=gen)  # [out, in], [out]
    x = torch.randn(33, 96, generator=gen)
    quantization = "int8" if weight_format == "int8" else None
    prepared = LinearWeight.prepare(weight.bfloat16(), bias.bfloat16(), KernelBackend.NATIVE, quantization)
    assert prepared.layout is WeightLayout.NATIVE
    assert prepared.weight.dtype == (torch.int8 if quantization else torch.bfloat16)
    scale_bytes = 200 * 4 if quantization else 0
    assert prepared.weight_bytes == prepared.weight.numel() * (1 if quantization else 2) + scale_bytes
    held = weight.bfloat16().float()  # [out, in]: the values the panels hold, rounding included
    if quantization:
        q, scales = quantize_int8(weight.bfloat16())
        held = q.float() * scales[:, None]
    assert_scaled_close(linear(x, prepared), F.linear(x, held, bias.bfloat16().float()), seed)


@pytest.mark.parametrize("activation_dtype", [torch.float32, torch.bfloat16])
def test_torch_int8_weights_take_activations_in_the_model_dtype(activation_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(200, 96, generator=gen) / 10, torch.randn(200, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    prepared = LinearWeight.prepare(weight.to(activation_dtype), bias.to(activation_dtype), KernelBackend.TORCH, "int8")
    assert prepared.layout is WeightLayout.INT8
    out = linear(x.to(activation_dtype), prepared)  # [5, 200]
    assert out.dtype == activation_dtype
    q, scales = prepared.weight, prepared.scales
    expected = F.linear(x, q.float() * scales[:, None], bias)
    tolerance = 1e-4 if activation_dtype == torch.float32 else 3e-2
    assert ((out.float() - expected).abs() / (1 + expected.abs())).max() <= tolerance, f"seed={seed}"
