"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter; slow set-up runs in the background.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports a kernel. tests/background_jobs.py runs the demo adapters' training and the AVX2 build of the native
kernels while the other tests run.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.background_jobs"]
