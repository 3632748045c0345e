"""Fixtures of the kernel tests: the native CPU library (a failure where it should build and does not), its AVX2
build, and a fresh seed per test."""

import random

import pytest

from tests.background_jobs import job_for
from tests.native_required import require_native_ops

AVX2_BUILD_WAIT_S = 900  # what test_avx2_build.py allows its child pytest, the build included


@pytest.fixture(scope="session")
def native() -> object:
    """``torch.ops.loraplex``, built on first use."""
    return require_native_ops()


@pytest.fixture(scope="session")
def avx2_library(request: pytest.FixtureRequest) -> None:
    """The native library built for AVX2 only, by the job that started with the session's tests
    (tests/background_jobs.py); without that job, test_avx2_build.py's child pytest builds it."""
    if job := job_for(request, "avx2_library"):
        job.wait(AVX2_BUILD_WAIT_S)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, shown when a comparison fails so the case can be replayed."""
    return random.randrange(2**31)
