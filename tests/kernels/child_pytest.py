"""Running some of the suite's tests in a child pytest with another environment (a build target, no compiler)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_child_pytest(
    tests: Sequence[str], env: Mapping[str, str], timeout_s: float, options: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``pytest -q tests`` from the repository root in ``env`` (plugins not autoloaded: seconds of start-up
    saved, none of these tests needs one), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, *tests],
        cwd=ROOT,
        env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
