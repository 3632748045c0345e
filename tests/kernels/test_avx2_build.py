"""The native kernels' AVX2 code paths, built for an AVX2-only x86 target and tested, on any x86-64 CPU.

The suite's other kernel tests run the build for this CPU's own instruction set (AVX-512 where it has it);
this one runs the native kernel tests in a child pytest with ``LORAPLEX_NATIVE_MARCH=haswell``, which
loads the library built a second time for AVX2 + FMA only (a library of its own name, kept beside the first): built
by the fixture ``avx2_library``'s background job while the session's other tests run, else by the child itself.
"""

import os
import platform

import pytest

from loraplex_kernels.native_cpu import AVX2_MARCH, MARCH_ENV, cpu_flags
from tests.kernels.child_pytest import run_child_pytest

RUN_TIMEOUT_S = 900  # the AVX2 build (~1 min on two cores, once per source change) and the tests
NATIVE_TESTS = [
    "tests/kernels/test_paged_attention_native.py",
    "tests/kernels/test_bf16_kv_native.py",
    "tests/kernels/test_glue_ops_native.py",
    "tests/kernels/test_sgmv_fused_native.py",
    "tests/kernels/test_linear_packed_native.py",
    "tests/kernels/test_linear_dot_native.py",
    "tests/kernels/test_linear_vnni_native.py",
    "tests/kernels/test_linear_silu_mul_native.py",
    "tests/kernels/test_argmax_rows_native.py",
    "tests/kernels/test_row_invariance_native.py",
]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is an x86-64 instruction set")
@pytest.mark.skipif("avx2" not in cpu_flags().split(), reason="this CPU cannot run an AVX2 build")
@pytest.mark.usefixtures("avx2_library")
def test_native_kernels_pass_when_built_for_avx2_only() -> None:
    result = run_child_pytest(NATIVE_TESTS, {**os.environ, MARCH_ENV: AVX2_MARCH}, RUN_TIMEOUT_S, ("-p", "anyio"))
    summary = result.stdout.splitlines()[-1] if result.stdout else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, summary
