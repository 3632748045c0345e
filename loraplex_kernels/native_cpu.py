"""The native CPU kernels (``loraplex_kernels/csrc``): built once per machine on first use, then loaded.

The C++ sources compile with ``torch.utils.cpp_extension.load`` into torch's extensions folder, under a
name keyed by a hash of the sources, the torch version, the compiler flags and the CPU's feature flags,
so a changed source, a new torch or another CPU gets its own build and an unchanged one loads in
milliseconds. The first build compiles one translation unit per op, in parallel, and takes under a minute
on two cores (docs/native-cpu-kernels.md#build has the figures). The set-up step builds it
(``loraplex kernels build``), so the engine's first start finds it built; :mod:`loraplex_kernels.build_lock`
lets one process build at a time and clears the lock a killed build leaves behind.

LORAPLEX_NATIVE_MARCH (e.g. ``haswell``) builds for another x86 target than this CPU's own, so the AVX2
code paths can be built and tested on an AVX-512 machine.

The library registers its ops as ``torch.ops.loraplex.*``. Without a C++ compiler, or when the build
fails, :func:`native_ops` returns None and logs why, :func:`unavailable_reason` says it for error
messages, and :func:`require_native_ops` (what the ops call) raises NativeKernelsUnavailableError.
"""

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex_kernels.build_lock import build_folder, load_library

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -O3 for the vector loops; OpenMP for the threads (the library shares torch's OpenMP runtime, which is
# already loaded under the same soname); the host's own instruction set (AVX2 + FMA at least on x86).
BASE_FLAGS = ("-O3", "-fopenmp")
X86_FLAGS = ("-march=native",)
MARCH_ENV = "LORAPLEX_NATIVE_MARCH"  # another -march target than this CPU's, for testing its code paths
AVX2_MARCH = "haswell"  # the -march of an AVX2 + FMA build without AVX-512, which the tests build too
BUILD_SECONDS_HINT = 40  # what the log line promises: a build on two cores (docs/native-cpu-kernels.md#build)

_LOCK = threading.Lock()  # one build per process even when two threads ask first


@dataclass(frozen=True, slots=True)
class NativeBuild:
    """The outcome of loading the library: its ops namespace, or why there is none."""

    ops: object | None
    reason: str | None
    folder: Path | None = None  # the build folder in torch's extensions folder, where the library is


class NativeKernelsUnavailableError(RuntimeError):
    """The native kernels were asked for but cannot be built or loaded here; the message says why."""


def native_ops() -> object | None:
    """``torch.ops.loraplex`` once the library is built and loaded, else None (the reason is logged)."""
    return _build().ops


def require_native_ops() -> object:
    """``torch.ops.loraplex``, or NativeKernelsUnavailableError saying why it cannot be had."""
    build = _build()
    if build.ops is None:
        raise NativeKernelsUnavailableError(f"the native CPU kernels are unavailable: {build.reason}")
    return build.ops


def build_native() -> NativeBuild:
    """Build (when needed) and load the library now: its ops and build folder, or why there is none."""
    return _build()


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here (None when they can)."""
    return _build().reason


def _build() -> NativeBuild:
    with _LOCK:
        return _build_once()


@functools.cache
def _build_once() -> NativeBuild:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)"
        logger.warning("native CPU kernels unavailable: %s", reason)
        return NativeBuild(None, reason)
    sources = sorted(CSRC.glob("*.cpp"))
    flags = list(BASE_FLAGS) + _x86_flags()
    name = f"loraplex_native_{_build_key(flags)}"
    started = time.perf_counter()
    try:
        folder = build_folder(name)
        if not (folder / f"{name}.so").is_file():
            logger.info("building native CPU kernels in %s (once, ~%d s)", folder, BUILD_SECONDS_HINT)
        load_library(name, sources, flags, ["-fopenmp"], [CSRC])
    except (RuntimeError, OSError, ImportError, ValueError, AttributeError) as error:  # BuildLockTimeoutError too
        reason = f"building the native CPU kernels failed: {str(error).strip()[-2000:]}"
        logger.warning("native CPU kernels unavailable: %s", reason)
        return NativeBuild(None, reason)
    logger.info("native CPU kernels %s ready in %.1f s", name, time.perf_counter() - started)
    return NativeBuild(torch.ops.loraplex, None, folder)


def _x86_flags() -> list[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    march = os.environ.get(MARCH_ENV)
    return [f"-march={march}"] if march else list(X86_FLAGS)


def _build_key(flags: list[str]) -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(flags).encode())
    digest.update(cpu_flags().encode())
    # torch rebuilds a library whose sources moved (their paths are part of its build arguments): two
    # checkouts on one machine get a build each instead of rebuilding over each other's.
    digest.update(str(CSRC.resolve()).encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the machine name where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + platform.processor()
