"""Fixtures of the kernel tests: the native CPU library, a failure where it should build and does not."""

import pytest

from tests.native_required import require_native_ops


@pytest.fixture(scope="session")
def native() -> object:
    """``torch.ops.loraplex``, built on first use."""
    return require_native_ops()
