"""Two steps of scripts/tools/gpu_checks.py's ``run``, each in a process of its own: the op checks through the
Triton kernels on the device, and the packages' versions beside the lock's.
"""

import json
import logging
import math
import platform
import sys
import time
from pathlib import Path

from scripts.tools.gpu_prepare import CARRIED_PACKAGES, lock_pins, normalize

logger = logging.getLogger("gpu_checks")

CUDA_DTYPES = ("float32", "float16", "bfloat16")
VERSION_PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "peft", "numpy", "pytest")


def check_ops(device_name: str, dtype_names: list[str], report: Path | None) -> int:
    """Each op of op_checks through the Triton kernels on ``device_name`` in each dtype; 1 if any fails."""
    import torch
    import triton

    from loraplex_kernels.backend import KernelBackend, compiled_triton_functions
    from loraplex_kernels.op_checks import OPS, run_op_check
    from loraplex_kernels.triton_aot import find_kernels

    device = torch.device(device_name)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    kernels, compiled = find_kernels(), compiled_triton_functions()
    write = sys.stdout.write
    write(f"{name}: torch {torch.__version__}, triton {triton.__version__}, ")
    write(f"{len(compiled)} of {len(kernels)} Triton kernels compiled (the rest interpreted)\n")
    rows = []
    for dtype_name in dtype_names:
        dtype = getattr(torch, dtype_name)
        for op in OPS:
            started = time.perf_counter()
            try:
                check = run_op_check(op, device, dtype, KernelBackend.TRITON)
            except Exception as error:  # an op that raises is a failed check; the next one still runs
                logger.exception("%s in %s", op, dtype_name)
                row = {"op": op, "dtype": dtype_name, "passed": False, "error": f"{type(error).__name__}: {error}"}
                outcome = row["error"]
            else:
                error_value = None if math.isnan(check.max_error) else check.max_error  # JSON has no NaN
                row = {"op": op, "dtype": dtype_name, "passed": check.passed, "max_error": error_value}
                row["tolerance"] = check.tolerance
                outcome = f"max error {check.max_error:.1e} (tolerance {check.tolerance:.0e})"
            row["seconds"] = round(time.perf_counter() - started, 2)
            rows.append(row)
            write(f"{dtype_name:<9} {op:<16} {'pass' if row['passed'] else 'FAIL'}  {outcome}  {row['seconds']} s\n")
    passed = sum(row["passed"] for row in rows)
    write(f"{passed} of {len(rows)} op checks passed\n")
    if report is not None:
        result = {"device": name, "torch": torch.__version__, "triton": triton.__version__}
        result |= {"triton_kernels": len(kernels), "compiled_kernels": len(compiled), "checks": rows}
        report.write_text(json.dumps(result) + "\n")
    return 0 if passed == len(rows) else 1


def write_versions() -> int:
    """Python's and each package's version here, beside requirements.lock's; the CUDA device torch sees."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    pins = lock_pins()
    write = sys.stdout.write
    write(f"python {platform.python_version()} at {sys.executable}\n")
    for name in (*VERSION_PACKAGES, *CARRIED_PACKAGES):
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "missing"
        write(f"{name:<13} {installed:<16} lock {pins.get(normalize(name), '-')}\n")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    write(f"torch CUDA {torch.version.cuda}, device {device}\n")
    return 0
