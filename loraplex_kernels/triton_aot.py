"""Ahead-of-time compile of every Triton kernel in this package for real GPUs, with no GPU present.

Triton's compiler and the ``ptxas`` shipped in the triton wheel build a cubin for a target given by hand,
so each kernel is compiled for sm_80 and sm_90 in every dtype its launcher accepts, with the constexprs
and ``num_warps`` its launcher passes (the module's ``triton_launches()``, see ``loraplex_kernels.triton_launch``).
That catches what the interpreter forgives: ``tl.dot`` shapes under 16, dtype mismatches, ops a target
lacks. The kernels are found by walking the package, so a new kernel is covered without a list to edit;
one without a launch spec is a failed result that names it.

What is compiled: every pointer argument aligned to 16 bytes (as a torch allocation is, and as the
runtime then specializes it); every ``stride_*`` int, and the ints of _MODEL_SHAPE_INTS, that the kernel lets
the runtime specialize (not in its ``do_not_specialize``) divisible by 16, as the runtime specializes them for
a model whose head and hidden sizes are multiples of 16 (without that no load of a gathered row is known to
be 16-byte aligned, and the loads that feed ``tl.dot`` are neither vectorized nor pipelined: the registers
and shared memory reported would be another kernel's); every other int as a generic ``i32`` (the runtime
also compiles a variant for an int equal to 1; that is not built here).

``triton.jit`` picks the interpreter when a kernel is defined under ``TRITON_INTERPRET=1`` (as the test
session sets it), so this must run in a process without it: ``scripts/tools/triton_aot_report.py``.
"""

import importlib
import pkgutil
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import KernelInterface
from triton.runtime.jit import JITFunction

from loraplex_kernels.triton_launch import TritonLaunch, kernel_name

# Ampere (A100, A10, RTX 30xx) and Hopper (H100): the GPUs a gateway serving adapters runs on.
TARGET_ARCHS = (80, 90)
_WARP_SIZE = 32
_RESOURCE_RE = re.compile(r"REG:(\d+) STACK:(\d+)")
_NARROW_LOAD_RE = re.compile(r"\bld\.global(?:\.\w+)*\.[bu]16\b")
# Int parameters besides the strides that are multiples of 16 at model shapes: a projection's input width, and
# the pool's offset of a layer (a multiple of its pages' layer slice).
_MODEL_SHAPE_INTS = ("in_dim", "layer_offset")


class AotEnvironmentError(RuntimeError):
    """The kernels cannot be compiled in this process (they were defined for the interpreter)."""


@dataclass(frozen=True, slots=True)
class AotResult:
    """One kernel compiled for one target in one dtype (or a kernel found with no launch spec)."""

    kernel: str  # module.function
    target: str  # "sm_80"; "" for a kernel with no launch spec
    dtype: str  # "bfloat16"; "" for a kernel with no launch spec
    ok: bool
    registers: int | None  # per thread, from the cubin
    shared_bytes: int | None  # dynamic shared memory per program, from Triton's metadata
    stack_bytes: int | None  # per-thread stack frame in the cubin: where ptxas spills registers (0: no spills)
    narrow_loads: int | None  # 2-byte global loads in the PTX: a 16-bit tile read an element at a time
    compile_seconds: float
    error: str  # the compiler's message when not ok, else ""


def package_modules() -> Iterator[ModuleType]:
    """Every module of the ``kernels`` package, imported."""
    package = importlib.import_module("loraplex_kernels")
    for info in pkgutil.walk_packages(package.__path__, "loraplex_kernels."):
        yield importlib.import_module(info.name)


def find_kernels() -> dict[str, Any]:
    """Every ``@triton.jit`` kernel defined in a module of the package, by ``module.function``; a module's
    ``DEVICE_FUNCTIONS`` (``@triton.jit`` functions its kernels call) are not kernels.

    Autotuner and heuristics wrappers are looked through to the function they wrap. Finds
    ``JITFunction`` objects, or ``InterpretedFunction`` ones under ``TRITON_INTERPRET=1``.
    """
    kernels: dict[str, Any] = {}
    for module in package_modules():
        device_functions = getattr(module, "DEVICE_FUNCTIONS", ())  # called from kernels, never launched
        for value in vars(module).values():
            while isinstance(getattr(value, "fn", None), KernelInterface):
                value = value.fn
            defined_here = isinstance(value, KernelInterface) and value.fn.__module__ == module.__name__
            if defined_here and not any(value is function for function in device_functions):
                kernels[kernel_name(value)] = value
    return kernels


def find_launches() -> dict[str, list[TritonLaunch]]:
    """Every module's ``triton_launches()``, by the kernel they launch."""
    launches: dict[str, list[TritonLaunch]] = {}
    for module in package_modules():
        for launch in getattr(module, "triton_launches", tuple)():
            launches.setdefault(launch.kernel_name, []).append(launch)
    return launches


def dtype_name(launch: TritonLaunch) -> str:
    return str(launch.dtype).removeprefix("torch.")


def compile_launch(launch: TritonLaunch, arch: int) -> AotResult:
    """Compile one launch for ``sm_<arch>``; a compiler error is a result with ``ok`` False, not a raise."""
    if not isinstance(launch.kernel, JITFunction):
        raise AotEnvironmentError(
            f"{launch.kernel_name} is a {type(launch.kernel).__name__}: run without TRITON_INTERPRET "
            "(triton.jit reads it when a kernel is defined)"
        )
    src = ASTSource(
        launch.kernel,
        dict(launch.signature),
        dict(launch.constexprs),
        attrs={(i,): [["tt.divisibility", 16]] for i in _aligned_args(launch)},
    )
    target = f"sm_{arch}"
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, _WARP_SIZE), options={"num_warps": launch.num_warps}
        )
        registers, stack_bytes = cubin_resources(compiled.asm["cubin"])
    except Exception as exc:  # any failure of the compiler or ptxas is this launch's result
        seconds = time.perf_counter() - start
        message = f"{type(exc).__name__}: {exc}".strip()
        return AotResult(
            launch.kernel_name, target, dtype_name(launch), False, None, None, None, None, seconds, message
        )
    seconds = time.perf_counter() - start
    return AotResult(
        launch.kernel_name,
        target,
        dtype_name(launch),
        True,
        registers,
        compiled.metadata.shared,
        stack_bytes,
        len(_NARROW_LOAD_RE.findall(compiled.asm["ptx"])),
        seconds,
        "",
    )


def _aligned_args(launch: TritonLaunch) -> list[int]:
    """Positions of the arguments compiled as divisible by 16: the pointers, and the strides and model widths the
    runtime specializes."""
    generic = set(launch.kernel.do_not_specialize)  # names, or positions in some Triton versions
    aligned = []
    for i, (name, kind) in enumerate(launch.signature.items()):
        shape_int = kind == "i32" and (name.startswith("stride_") or name in _MODEL_SHAPE_INTS)
        if kind.startswith("*") or (shape_int and not generic & {name, i}):
            aligned.append(i)
    return aligned


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the one kernel in a cubin, by the wheel's cuobjdump."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    match = _RESOURCE_RE.search(listing)
    if match is None:
        raise AotEnvironmentError(f"cuobjdump printed no resource usage:\n{listing}")
    return int(match.group(1)), int(match.group(2))


def compile_all(archs: tuple[int, ...] = TARGET_ARCHS) -> list[AotResult]:
    """Every kernel of the package in every launch for every target; a kernel with no launch spec fails."""
    launches = find_launches()
    results: list[AotResult] = []
    for name in sorted(find_kernels()):
        if name not in launches:
            error = f"no launch spec: {name} is not listed by its module's triton_launches()"
            results.append(AotResult(name, "", "", False, None, None, None, None, 0.0, error))
            continue
        results += [compile_launch(launch, arch) for arch in archs for launch in launches[name]]
    return results
