"""A broken native build on a CPU the library builds for shows as failures, not skips, in every test that needs it.

The kernel tests (their ``native`` fixture), the doctor's and the backend's are run in a child pytest with
no C++ compiler to be found, as on a developer's machine without one, and without ``CI`` set.
"""

import os
import platform

import pytest

from tests.kernels.child_pytest import run_child_pytest
from tests.native_required import NATIVE_MACHINES

RUN_TIMEOUT_S = 600
NEEDS_NATIVE = [
    "tests/kernels/test_argmax_rows_native.py::test_bad_inputs_are_refused",
    "tests/app/test_doctor.py::test_cpu_path_report",
    "tests/engine/test_kernel_backend.py::test_auto_runs_the_native_kernels_where_they_build",
]


@pytest.mark.skipif(platform.machine() not in NATIVE_MACHINES, reason="the native library does not build here")
def test_no_compiler_fails_every_test_that_needs_the_native_library() -> None:
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env["CXX"] = "loraplex-test-no-such-compiler"
    result = run_child_pytest(NEEDS_NATIVE, env, RUN_TIMEOUT_S, ("-rfEs",))
    summary = result.stdout.splitlines()[-1]
    assert result.returncode == 1, result.stdout[-3000:]
    assert "skipped" not in summary and "passed" not in summary, summary
    assert result.stdout.count("should build on this") >= len(NEEDS_NATIVE), result.stdout[-3000:]
