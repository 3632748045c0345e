"""Fixtures of the kernel tests: the native CPU library, skipped (with the reason) only where it cannot be built.

In CI (``CI`` set) the machine has a compiler, so a library that does not build fails the tests instead.
"""

import os

import pytest

from kernels.native_cpu import native_ops, unavailable_reason


@pytest.fixture(scope="session")
def native() -> object:
    """``torch.ops.loraplex``, built on first use."""
    ops = native_ops()
    if ops is None:
        if os.environ.get("CI"):
            pytest.fail(f"native CPU kernels unavailable in CI: {unavailable_reason()}")
        pytest.skip(f"native CPU kernels unavailable: {unavailable_reason()}")
    return ops
