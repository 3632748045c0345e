"""`loraplex kernels build`, what set-up runs: the library's folder where it builds, a non-zero exit that says why
where it cannot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.child_pytest import ROOT
from tests.native_required import native_should_build

BUILD_TIMEOUT_S = 900  # a first build on a busy two-core machine; seconds once set-up has built it


def _kernels_build(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "app.cli.main", "kernels", "build"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


@pytest.mark.skipif(not native_should_build(), reason="the native library does not build for this CPU")
def test_build_prints_the_folder_of_the_library() -> None:
    result = _kernels_build(dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert list(folder.glob("loraplex_native_*.so")), f"no library in {folder}"


def test_build_without_a_compiler_exits_non_zero_and_says_why() -> None:
    result = _kernels_build({**os.environ, "CXX": "loraplex-test-no-such-compiler"})
    assert result.returncode == 1
    assert "no C++ compiler: 'loraplex-test-no-such-compiler' is not on PATH" in result.stderr
    assert "The engine runs torch's kernels instead" in result.stderr
