"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter; slow set-up runs in the background.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports a kernel, and the interpreter's bfloat16 ``tl.dot`` is made to multiply values
(tests/triton_bf16_dot.py). tests/background_jobs.py runs the demo adapters' training and the AVX2 build of the native
kernels while the other tests run.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.triton_bf16_dot import widen_bf16_dot_operands

widen_bf16_dot_operands()

pytest_plugins = ["tests.background_jobs"]
