"""The native CPU library in tests: a failure, never a skip, on a CPU it builds for.

The library has portable fallbacks for every vector path, so it builds on any x86-64 or 64-bit Arm machine
that has a C++ compiler. A test there that finds it missing reports the broken build (or the missing
compiler) as a failure; only on other machines is it a skip.
"""

import platform

import pytest

from loraplex_kernels.native_cpu import native_ops, unavailable_reason

NATIVE_MACHINES = ("x86_64", "AMD64", "aarch64", "arm64")  # what platform.machine() names them


def native_should_build() -> bool:
    """Whether this machine's CPU is one the native library builds for (then it must be there)."""
    return platform.machine() in NATIVE_MACHINES


def require_native_ops() -> object:
    """``torch.ops.loraplex``; fails the test where the library should build and does not, else skips it."""
    ops = native_ops()
    if ops is not None:
        return ops
    if native_should_build():
        pytest.fail(
            f"the native CPU kernels should build on this {platform.machine()} CPU but are unavailable: "
            f"{unavailable_reason()}"
        )
    pytest.skip(f"native CPU kernels do not build for {platform.machine()}: {unavailable_reason()}")
