"""Fixtures of the kernel tests: the native CPU library (a failure where it should build and does not), and a
fresh seed per test."""

import random

import pytest

from tests.native_required import require_native_ops


@pytest.fixture(scope="session")
def native() -> object:
    """``torch.ops.loraplex``, built on first use."""
    return require_native_ops()


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)
