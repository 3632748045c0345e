"""The GEMM of bf16 and int8 weights on the native kernels: the chooser on given timings, the setting's values
and errors, the measured choice an engine reports, and that an engine forced onto the dot-product panels
decodes as the widened one does."""

import time
from pathlib import Path

import pytest
import torch

from app.model_store import resolve_model
from app.settings import Settings, SettingsError
from engine import EngineConfig, SamplingParams
from engine.errors import ConfigError
from engine.modeling import bf16_gemm as bf16_gemm_module
from engine.modeling.bf16_gemm import MIN_ROUNDS, choose_gemm, resolve_bf16_gemm, time_gemms
from loraplex_kernels import native_cpu
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import DOT, WIDEN, WeightLayout
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from loraplex_kernels.projection.linear_vnni import vnni_available
from tests.engine.conftest import make_engine

CPU = torch.device("cpu")
GATE_UP = (3072, 576)  # the default model's gate/up projection [out_features, in_features]
MAX_CALIBRATION_S = 0.5  # what an engine's start may spend timing the two GEMMs
GREEDY_TOKENS = 16


def skip_unless_dot_runs(weight_format: str) -> None:
    """Skip where ``weight_format``'s dot-product panels cannot run (bf16: avx512_bf16 or amx_bf16; int8:
    avx512_vnni)."""
    runs = vnni_available() if weight_format == "int8" else dot_available() or amx_available()
    if native_cpu.native_ops() is None or not runs:
        pytest.skip(f"the {weight_format} dot-product panels need the native kernels built for a CPU that has them")


def dot_layout(weight_format: str) -> WeightLayout:
    """The layout of ``weight_format`` weights on their dot GEMM here (bf16: AMX tiles where they run)."""
    if weight_format == "int8":
        return WeightLayout.NATIVE_VNNI
    return WeightLayout.NATIVE_AMX if amx_available() else WeightLayout.NATIVE_DOT


def test_the_chooser_keeps_the_lower_median_and_says_by_how_much(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_gemm_module, "amx_available", lambda: False)
    choice = choose_gemm([0.0201, 0.0199, 0.0500], [0.0123, 0.0124, 0.0119], 64, "bfloat16")  # a slow sample
    assert choice.gemm == DOT
    assert choice.reason == (
        "bf16 GEMM dot (vdpbf16ps on projection inputs rounded to bf16): dot tile 12.30 ms vs widened 20.10 ms "
        "at 64 rows, measured at load"
    )
    assert choose_gemm([0.010, 0.011, 0.012], [0.013, 0.009, 0.014], 8, "bfloat16").gemm == WIDEN  # 11 vs 13 ms
    assert choose_gemm([0.010], [0.010], 64, "int8").gemm == WIDEN  # a tie keeps the widened panels
    assert choose_gemm([0.0115], [0.0058], 64, "int8").reason == (
        "int8 GEMM dot (vpdpbusd on projection inputs quantized to int8 per block of 32): dot tile 5.80 ms vs "
        "widened 11.50 ms at 64 rows, measured at load"
    )
    monkeypatch.setattr(bf16_gemm_module, "amx_available", lambda: True)  # bf16's dot GEMM is then AMX's
    assert choose_gemm([0.0201], [0.0050], 64, "bfloat16").reason.startswith(
        "bf16 GEMM dot (AMX tiles (tdpbf16ps) on projection inputs rounded to bf16): dot tile 5.00 ms"
    )
    assert choose_gemm([0.0115], [0.0058], 64, "int8").reason.startswith("int8 GEMM dot (vpdpbusd on")


def test_the_setting_is_read_and_checked() -> None:
    assert Settings.from_env({}).bf16_gemm == "auto"
    assert Settings.from_env({"LORAPLEX_BF16_GEMM": "Dot"}).bf16_gemm == "dot"
    with pytest.raises(SettingsError, match="LORAPLEX_BF16_GEMM must be one of auto, widen, dot"):
        Settings.from_env({"LORAPLEX_BF16_GEMM": "amx"})
    with pytest.raises(ConfigError, match="bf16_gemm must be one of auto, widen, dot"):
        EngineConfig(model="x", bf16_gemm="fast")


def test_no_choice_for_float32_weights_the_torch_kernels_or_cuda() -> None:
    native = KernelBackend.NATIVE
    assert resolve_bf16_gemm("auto", "float32", CPU, native, GATE_UP, 64) is None
    assert resolve_bf16_gemm("widen", "bfloat16", CPU, KernelBackend.TORCH, GATE_UP, 64) is None
    assert resolve_bf16_gemm("dot", "bfloat16", torch.device("cuda"), KernelBackend.TRITON, GATE_UP, 64) is None
    with pytest.raises(ConfigError, match="engine runs the torch kernels; use 'auto' or 'widen'"):
        resolve_bf16_gemm("dot", "bfloat16", CPU, KernelBackend.TORCH, GATE_UP, 64)


def test_dot_is_refused_on_a_cpu_without_its_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_gemm_module, "dot_available", lambda: False)
    monkeypatch.setattr(bf16_gemm_module, "amx_available", lambda: False)
    monkeypatch.setattr(bf16_gemm_module, "vnni_available", lambda: False)
    monkeypatch.setattr(bf16_gemm_module, "cpu_flags", lambda: "avx2 fma avx512f")
    with pytest.raises(ConfigError, match=r"this CPU has no AVX512-BF16 dot products .* use 'auto' or 'widen'"):
        resolve_bf16_gemm("dot", "bfloat16", CPU, KernelBackend.NATIVE, GATE_UP, 64)
    with pytest.raises(ConfigError, match=r"this CPU has no AVX512-VNNI dot products .* use 'auto' or 'widen'"):
        resolve_bf16_gemm("dot", "int8", CPU, KernelBackend.NATIVE, GATE_UP, 64)
    choice = resolve_bf16_gemm("auto", "int8", CPU, KernelBackend.NATIVE, GATE_UP, 64)
    assert choice is not None and choice.gemm == WIDEN and "no AVX512-VNNI" in choice.reason
    choice = resolve_bf16_gemm("auto", "bfloat16", CPU, KernelBackend.NATIVE, GATE_UP, 64)
    assert choice is not None and choice.gemm == WIDEN and "no AVX512-BF16" in choice.reason


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
def test_auto_times_both_on_the_shape_at_the_full_batch(weight_format: str) -> None:
    skip_unless_dot_runs(weight_format)
    widen_s, dot_s = time_gemms(GATE_UP, 64, weight_format == "int8")
    assert len(widen_s) == len(dot_s) >= MIN_ROUNDS
    started = time.perf_counter()
    choice = resolve_bf16_gemm("auto", weight_format, CPU, KernelBackend.NATIVE, GATE_UP, 64)
    assert time.perf_counter() - started < MAX_CALIBRATION_S
    assert choice is not None and choice.gemm in (WIDEN, DOT)
    label = "int8" if weight_format == "int8" else "bf16"
    assert choice.reason.startswith(f"{label} GEMM {choice.gemm} (") and "): dot tile " in choice.reason
    assert choice.reason.endswith(" at 64 rows, measured at load")


def test_an_engine_reports_its_measured_choice(tiny_llama: Path) -> None:
    skip_unless_dot_runs("bfloat16")
    engine = make_engine(tiny_llama, kernels="native", dtype="bfloat16", bf16_gemm="auto", max_num_seqs=16)
    stats = engine.stats()
    assert stats.bf16_gemm in (WIDEN, DOT)
    assert f"bf16 GEMM {stats.bf16_gemm} (" in stats.precision_reason and "): dot tile " in stats.precision_reason
    assert "at 16 rows, measured at load" in stats.precision_reason
    layout = dot_layout("bfloat16") if stats.bf16_gemm == DOT else WeightLayout.NATIVE
    assert engine.model.weights.layers[0].gate_up.layout is layout
    fp32 = make_engine(tiny_llama, kernels="native", dtype="float32", bf16_gemm="auto")
    assert fp32.stats().bf16_gemm == "" and "GEMM" not in fp32.stats().precision_reason


@pytest.mark.default_model
@pytest.mark.parametrize(("quantization", "label"), [(None, "bf16"), ("int8", "int8")])
def test_forcing_dot_decodes_as_the_widened_engine(quantization: str | None, label: str) -> None:
    """The dot panels round (bf16) or quantize per block of 32 (int8) each projection's input too, so a long
    greedy continuation may part at a near tie (bench_quality measures how often); two short ones with clear
    leaders agree token for token."""
    skip_unless_dot_runs(quantization or "bfloat16")
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    prompts = ["Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for gemm in (WIDEN, DOT):
        engine = make_engine(
            folder, dtype="bfloat16", quantization=quantization, bf16_gemm=gemm, pool_bytes=64 * 1024**2
        )
        stats = engine.stats()
        assert stats.bf16_gemm == gemm and f"{label} GEMM {gemm} (" in stats.precision_reason
        assert f"bf16_gemm={gemm} was asked for" in stats.precision_reason
        layout = dot_layout(quantization or "bfloat16") if gemm == DOT else WeightLayout.NATIVE
        assert engine.model.weights.layers[0].qkv.layout is layout
        outputs = engine.generate([engine.tokenizer.encode(prompt) for prompt in prompts], params)
        tokens[gemm] = [output.token_ids for output in outputs]
    assert tokens[DOT] == tokens[WIDEN]
