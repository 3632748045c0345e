"""`loraplex doctor` run in this process on the CPU path (CUDA hidden even where a GPU is present): the device,
the kernel backend, each native op against torch, the CUDA checks skipped one line each, a timed generate with
the tiny model; a disagreeing op or a missing model folder exit 1; a default model never pulled is a skip."""

import json
import math
import os
import re
from pathlib import Path

import click.testing
import pytest
import torch

from app.cli.main import cli
from engine.modeling.bf16_gemm import dot_runs
from loraplex_kernels import format_checks, op_checks
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import native_ops, unavailable_reason
from loraplex_kernels.projection import linear as linear_module
from tests.engine.tiny_models import make_tiny_model
from tests.native_required import native_should_build, require_native_ops

OPS = ("paged_attention", "sgmv_fused", "add_rms_norm", "rope_kv_write", "silu_mul", "linear", "argmax_rows")
WEIGHT_FORMATS = ("bfloat16", "int8")
KV_FORMATS = ("bfloat16",)
ADAPTER_FORMATS = ("bfloat16",)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("doctor-model"))


@pytest.fixture(scope="module")
def native_builds() -> bool:
    """Whether the native library builds here; on a CPU it builds for it must (its ops' lines then run, not skip)."""
    if native_should_build():
        require_native_ops()
    return native_ops() is not None


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def doctor(tmp_path: Path, model: str, *args: str) -> click.testing.Result:
    env = {"LORAPLEX_HOME": str(tmp_path / "home"), "LORAPLEX_MODEL": model}
    return click.testing.CliRunner().invoke(cli, ["doctor", *args], env=env, catch_exceptions=False)


def lines_by_name(output: str) -> dict[str, tuple[str, str]]:
    """``{check name: (status, detail)}`` from the text report: status, the name padded, two spaces, the detail."""
    rows = {}
    for line in output.splitlines()[:-1]:  # the last line is the summary
        status, name, detail = re.fullmatch(r"(ok|FAIL|skip) +(.+?)  +(.*)", line).groups()
        rows[name] = (status, detail)
    return rows


def test_cpu_path_report(tmp_path: Path, tiny_model: Path, native_builds: bool) -> None:
    result = doctor(tmp_path, str(tiny_model))
    assert result.exit_code == 0, result.output
    rows = lines_by_name(result.stdout)

    status, detail = rows["device"]
    assert status == "ok" and detail.startswith("cpu: ") and f"{os.cpu_count()} cores" in detail
    status, detail = rows["kernel backend"]
    assert status == "ok" and detail.startswith("native (" if native_builds else "torch (")
    for op in OPS:
        status, detail = rows[f"native {op}"]
        if native_builds:
            assert status == "ok" and "max error" in detail and "float32 on cpu" in detail, (op, detail)
        else:
            assert status == "skip" and detail == unavailable_reason()
        assert rows[f"cuda {op}"] == ("skip", f"no CUDA device (torch {torch.__version__} sees none)")
    status, detail = rows["generate"]
    assert status == "ok" and detail.startswith("32 of 32 tokens in ") and " tokens/s (" in detail
    assert tiny_model.name in detail
    status, detail = rows["precision"]
    assert status == "ok" and "weights" in detail and "activations" in detail
    for weight_format in WEIGHT_FORMATS:
        status, detail = rows[f"weights {weight_format}"]
        assert status == "ok" and "against float32 weights" in detail, detail
        if native_builds:  # every GEMM an engine of that format could time and keep here is checked
            panels = "widen and dot panels" if dot_runs(weight_format) else "widen panels"
            assert f"(native, {panels})" in detail, detail
    for kv_format in KV_FORMATS:
        status, detail = rows[f"kv {kv_format}"]
        assert (status == "ok" and "against float32 K/V" in detail) if native_builds else status == "skip", detail
    for adapter_format in ADAPTER_FORMATS:
        status, detail = rows[f"adapters {adapter_format}"]
        expected = status == "ok" and "against float32 adapters" in detail
        assert expected if native_builds else status == "skip", detail
    num_pool_formats = len(KV_FORMATS) + len(ADAPTER_FORMATS)
    num_ok = 2 + 1 + 1 + len(WEIGHT_FORMATS) + ((len(OPS) + num_pool_formats) if native_builds else 0)
    num_checks = 4 + 2 * len(OPS) + len(WEIGHT_FORMATS) + num_pool_formats
    assert result.stdout.splitlines()[-1] == f"{num_ok} passed, 0 failed, {num_checks - num_ok} skipped"


def test_json_report(tmp_path: Path, tiny_model: Path, native_builds: bool) -> None:
    result = doctor(tmp_path, str(tiny_model), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert report["passed"] is True
    assert list(checks) == [
        "device",
        "kernel backend",
        "precision",
        *(f"native {op}" for op in OPS),
        *(f"weights {name}" for name in WEIGHT_FORMATS),
        *(f"kv {name}" for name in KV_FORMATS),
        *(f"adapters {name}" for name in ADAPTER_FORMATS),
        *(f"cuda {op}" for op in OPS),
        "generate",
    ]
    assert checks["device"]["device"] == "cpu" and checks["device"]["cores"] == os.cpu_count()
    for op in OPS:
        native = checks[f"native {op}"]
        if native_builds:
            assert native["status"] == "pass" and 0 <= native["max_error"] <= native["tolerance"] == 1e-4
        assert checks[f"cuda {op}"]["status"] == "skip"
    generate = checks["generate"]
    assert generate["status"] == "pass" and generate["tokens"] == 32 and generate["tokens_per_s"] > 0


def test_an_op_that_disagrees_with_torch_fails(
    tmp_path: Path, tiny_model: Path, native_builds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native_builds:
        pytest.skip(f"the native ops' lines are skipped here: {unavailable_reason()}")
    real = op_checks.silu_mul
    monkeypatch.setattr(op_checks, "silu_mul", lambda gate_up, backend: real(gate_up, backend) * 1.01)
    result = doctor(tmp_path, str(tiny_model))
    assert result.exit_code == 1
    status, detail = lines_by_name(result.stdout)["native silu_mul"]
    assert status == "FAIL" and "tolerance 1e-04" in detail
    assert lines_by_name(result.stdout)["native add_rms_norm"][0] == "ok"


def test_a_nan_in_any_output_fails_the_check_whatever_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max`` over [0.001, nan] keeps 0.001: the largest error must be NaN wherever the NaN comes."""
    assert math.isnan(op_checks.largest_error([1e-3, math.nan])) and math.isnan(op_checks.largest_error([math.nan, 1]))
    assert op_checks.largest_error([1e-3, 0.5, 0.2]) == 0.5
    real = format_checks.linear_silu_mul  # the second of the weight check's two outputs
    row = torch.tensor([3])
    monkeypatch.setattr(format_checks, "linear_silu_mul", lambda *args: real(*args).index_fill_(0, row, math.nan))
    check = format_checks.run_weight_format_check("bfloat16", torch.bfloat16, KernelBackend.TORCH)
    assert math.isnan(check.max_error) and not check.passed


def test_precision_follows_the_settings_and_a_wrong_int8_projection_fails(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantize = linear_module.quantize_int8  # the doctor's check prepares weights as the engine does
    monkeypatch.setattr(linear_module, "quantize_int8", lambda w: (quantize(w)[0], quantize(w)[1] * 1.1))
    env = {
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_MODEL": str(tiny_model),
        "LORAPLEX_DTYPE": "float32",
        "LORAPLEX_QUANTIZATION": "int8",
    }
    result = click.testing.CliRunner().invoke(cli, ["doctor", "--json"], env=env, catch_exceptions=False)
    checks = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    assert checks["precision"]["weight_format"] == "int8" and checks["precision"]["dtype"] == "float32"
    assert "dtype=float32 was asked for: int8 weights" in checks["precision"]["detail"]
    assert checks["weights int8"]["status"] == "fail" and checks["weights bfloat16"]["status"] == "pass"
    assert result.exit_code == 1


def test_a_missing_model_folder_fails_and_a_default_never_pulled_is_skipped(tmp_path: Path) -> None:
    missing = doctor(tmp_path, str(tmp_path / "no-such-model"))
    assert missing.exit_code == 1
    status, detail = lines_by_name(missing.stdout)["generate"]
    assert status == "FAIL" and "does not exist" in detail

    never_pulled = doctor(tmp_path, "")  # empty: the default model
    status, detail = lines_by_name(never_pulled.stdout)["generate"]
    assert status == "skip" and "loraplex models pull" in detail
    assert never_pulled.exit_code == int(any(line.startswith("FAIL") for line in never_pulled.stdout.splitlines()))
    assert not (tmp_path / "home" / "models").exists(), "the doctor never downloads the model"


# Each op made 1 % wrong where the check calls it: the check must catch it.
PERTURBED = {
    "paged_attention": lambda real: lambda *args: real(*args) * 1.01,
    "sgmv_fused": lambda real: (
        lambda x, storage, meta, offset, y, *rest: (
            real(x, storage, meta, offset, y, *rest),
            y.mul_(1.01),
        )
    ),
    "add_rms_norm": lambda real: lambda *args: real(*args) * 1.01,
    "rope_kv_write": lambda real: lambda qkv, *rest: (real(qkv, *rest), qkv.mul_(1.01)),
    "silu_mul": lambda real: lambda *args: real(*args) * 1.01,
    "linear": lambda real: lambda *args: real(*args) * 1.01,
    "argmax_rows": lambda real: lambda logits, backend: (real(logits, backend) + 1) % logits.shape[-1],
}


@pytest.mark.parametrize("op", OPS)
def test_op_checks_pass_the_torch_ops_and_catch_a_wrong_one(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    check = op_checks.run_op_check(op, cpu, torch.float32, KernelBackend.TORCH)
    assert check.passed and check.max_error < 1e-6 and check.tolerance == 1e-4
    monkeypatch.setattr(op_checks, op, PERTURBED[op](getattr(op_checks, op)))
    wrong = op_checks.run_op_check(op, cpu, torch.float32, KernelBackend.TORCH)
    assert not wrong.passed and wrong.max_error > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_op_checks_through_the_triton_kernels(dtype: torch.dtype) -> None:
    """The doctor's `cuda …` checks as they run on a GPU (the Triton kernels for attention and SGMV, torch for
    the rest), under Triton's interpreter on the CPU (its bfloat16 tl.dot made to multiply values:
    tests/triton_bf16_dot.py)."""
    for op in OPS:
        check = op_checks.run_op_check(op, torch.device("cpu"), dtype, KernelBackend.TRITON)
        assert check.passed, check


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tolerances_leave_room_for_the_dtypes_rounding(dtype: torch.dtype) -> None:
    """The torch ops in bf16/fp16 against float32 err by the dtype's rounding: well inside the tolerance.
    The argmax rounds nothing (its inputs are rounded to the dtype for both sides), so it is exact."""
    for op in OPS:
        check = op_checks.run_op_check(op, torch.device("cpu"), dtype, KernelBackend.TORCH)
        if op == "argmax_rows":
            assert check.max_error == 0, check
        else:
            assert 0 < check.max_error < check.tolerance / 5, check


# (the check, the op it runs that a wrong kernel stands in for, the least error the bf16 rounding leaves)
POOL_FORMAT_CHECKS = {
    "kv": ("run_kv_format_check", "paged_attention", 1e-3),
    "adapters": ("run_adapter_format_check", "sgmv_fused", 5e-4),
}


@pytest.mark.parametrize("kind", POOL_FORMAT_CHECKS)
def test_pool_format_check_measures_the_rounding_and_catches_a_wrong_op(
    kind: str, native_builds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention and the K/V write on bf16 K/V, and the SGMV over bf16 adapter rows, against float32 pages err by
    the rounding alone, well inside the tolerance; the op off by 1 % fails the check."""
    if not native_builds:
        pytest.skip(f"the native kernels are not built here: {unavailable_reason()}")
    check_name, op, least_error = POOL_FORMAT_CHECKS[kind]
    run_check = getattr(format_checks, check_name)
    check = run_check("bfloat16", KernelBackend.NATIVE)
    assert check.passed and least_error < check.max_error < check.tolerance, check
    monkeypatch.setattr(op_checks, op, PERTURBED[op](getattr(op_checks, op)))
    assert not run_check("bfloat16", KernelBackend.NATIVE).passed
