"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports a kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
