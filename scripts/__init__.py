"""The repository's scripts, one package per kind: ``benchmarks`` (the figures of docs/benchmarks.md),
``drills`` (end-to-end runs of failure and scale-out paths), ``profilers`` (where the time goes), ``tools``
(the demo adapters, the console's vendored assets, the Triton AOT report) and ``common`` (what scripts of
several kinds share).

They import one another and the application by package, so they run as modules from the repository's root:
``python -m scripts.benchmarks.engine.bench_engine --json``.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository's root: where the scripts' child processes run, so that ``python -m scripts...`` imports."""
