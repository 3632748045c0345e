"""``loraplex doctor``'s kernel checks: each op of a decoder layer against torch (the native CPU library's and
CUDA's), and on CPU the projection on bf16 and int8 weights and the bf16 pool (K/V and adapter rows) against
float32, each within its stated tolerance (:mod:`loraplex_kernels.op_checks`, :mod:`loraplex_kernels.format_checks`)."""

from collections.abc import Callable
from typing import Any

import torch

from app.cli.doctor_results import CheckResult, Status
from engine.modeling.bf16_gemm import dot_runs
from engine.modeling.precision import dtype_name
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.format_checks import (
    ADAPTER_FORMAT_TOLERANCES,
    KV_FORMAT_TOLERANCES,
    WEIGHT_FORMAT_TOLERANCES,
    run_adapter_format_check,
    run_kv_format_check,
    run_weight_format_check,
)
from loraplex_kernels.native_cpu import unavailable_reason
from loraplex_kernels.op_checks import OPS, OpCheck, run_op_check
from loraplex_kernels.projection.linear import DOT, WIDEN


def check_weight_formats(device: torch.device, backend: KernelBackend | None) -> list[CheckResult]:
    """A projection and the gate/up projection with SiLU·mul on bf16 and on int8 weights, as a CPU engine
    would run them (with the native kernels, on each of the format's GEMMs that runs here, since an engine
    times them at load and keeps the faster), against float32 weights: the largest error of them."""
    formats = tuple(WEIGHT_FORMAT_TOLERANCES)
    if device.type != "cpu" or backend is None:
        reason = "the engine runs on CUDA: bf16 is its dtype there and int8 weights are CPU only"
        return [CheckResult(f"weights {name}", Status.SKIP, reason) for name in formats]
    activations = torch.float32 if backend is KernelBackend.NATIVE else torch.bfloat16
    native = backend is KernelBackend.NATIVE
    gemms = {name: (WIDEN, DOT) if native and dot_runs(name) else (WIDEN,) for name in formats}

    def kernels(name: str) -> str:
        return f"{backend.value}, {' and '.join(gemms[name])} panels" if native else backend.value

    return _format_checks(
        "weights",
        formats,
        lambda name: _worst([run_weight_format_check(name, activations, backend, gemm) for gemm in gemms[name]]),
        lambda name, check: (
            f"linear and gate/up + SiLU·mul on {name} weights, {dtype_name(activations)} activations "
            f"({kernels(name)}): max error "
            f"{check.max_error:.1e} against float32 weights (tolerance {check.tolerance:.0e})"
        ),
    )


def _worst(checks: list[OpCheck]) -> OpCheck:
    """The first check that fails (a NaN error fails), else the one with the largest error."""
    failed = [check for check in checks if not check.passed]
    return failed[0] if failed else max(checks, key=lambda check: check.max_error)


def check_pool_formats(device: torch.device, backend: KernelBackend | None) -> list[CheckResult]:
    """Attention and the K/V write on bf16 K/V pages, and the SGMV on bf16 adapter rows, as the native CPU
    kernels run them, against float32 pages."""
    kv_formats, adapter_formats = tuple(KV_FORMAT_TOLERANCES), tuple(ADAPTER_FORMAT_TOLERANCES)
    if device.type != "cpu" or backend is not KernelBackend.NATIVE:
        reason = "a bf16 pool beside float32 activations is the native kernels' mode; elsewhere it is the model's dtype"
        names = [f"kv {name}" for name in kv_formats] + [f"adapters {name}" for name in adapter_formats]
        return [CheckResult(name, Status.SKIP, reason) for name in names]
    kv = _format_checks(
        "kv",
        kv_formats,
        lambda name: run_kv_format_check(name, backend),
        lambda name, check: (
            f"attention and the K/V write on {name} K/V ({backend.value}): max error {check.max_error:.1e} "
            f"against float32 K/V (tolerance {check.tolerance:.0e})"
        ),
    )
    adapters = _format_checks(
        "adapters",
        adapter_formats,
        lambda name: run_adapter_format_check(name, backend),
        lambda name, check: (
            f"sgmv_fused on {name} adapter rows ({backend.value}): max error {check.max_error:.1e} "
            f"against float32 adapters (tolerance {check.tolerance:.0e})"
        ),
    )
    return kv + adapters


def _format_checks(
    kind: str, formats: tuple[str, ...], run: Callable[[str], Any], describe: Callable[[str, Any], str]
) -> list[CheckResult]:
    """One result per format: ``run(name)``'s check against its float32 reference (an op that raises fails it)."""
    results = []
    for name in formats:
        label = f"{kind} {name}"
        try:
            check = run(name)
        except Exception as error:  # an op that raises here is a failed check, not a crash
            results.append(CheckResult(label, Status.FAIL, f"{type(error).__name__}: {error}"))
            continue
        results.append(
            CheckResult(
                label,
                Status.PASS if check.passed else Status.FAIL,
                describe(name, check),
                {"max_error": check.max_error, "tolerance": check.tolerance},
            )
        )
    return results


def check_native_ops(device: torch.device, backend: KernelBackend | None) -> list[CheckResult]:
    """Each op on the native CPU library against torch, when the engine would run it."""
    if device.type != "cpu":
        return _skip_each("native", f"the engine runs on {device.type}; the native library serves CPU engines")
    if backend is not KernelBackend.NATIVE:
        return _skip_each("native", unavailable_reason() or "the engine runs the torch ops here")
    return [_op_result("native", op, torch.device("cpu"), torch.float32, backend) for op in OPS]


def check_cuda_ops(device: torch.device, dtype: torch.dtype, backend: KernelBackend | None) -> list[CheckResult]:
    """Each op on the CUDA device, as the engine runs it there, against torch on the CPU."""
    if device.type != "cuda":
        return _skip_each("cuda", f"no CUDA device (torch {torch.__version__} sees none)")
    if backend is None:
        return _skip_each("cuda", "no kernel backend could be chosen (see above)")
    return [_op_result("cuda", op, device, dtype, backend) for op in OPS]


def _op_result(side: str, op: str, device: torch.device, dtype: torch.dtype, backend: KernelBackend) -> CheckResult:
    name = f"{side} {op}"
    try:
        check = run_op_check(op, device, dtype, backend)
    except Exception as error:  # an op that raises on this device is a failed check, not a crash
        return CheckResult(name, Status.FAIL, f"{type(error).__name__}: {error}")
    return CheckResult(
        name,
        Status.PASS if check.passed else Status.FAIL,
        f"max error {check.max_error:.1e} (tolerance {check.tolerance:.0e}) against torch, "
        f"{str(dtype).removeprefix('torch.')} on {device.type}",
        {"max_error": check.max_error, "tolerance": check.tolerance},
    )


def _skip_each(side: str, reason: str) -> list[CheckResult]:
    return [CheckResult(f"{side} {op}", Status.SKIP, reason) for op in OPS]
