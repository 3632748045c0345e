"""bfloat16 ``tl.dot`` under Triton's interpreter, as the GPU computes it.

The interpreter keeps a bfloat16 tensor as its uint16 bit patterns and its ``tl.dot`` hands them to
``np.matmul`` as they are, so it multiplies the patterns as integers. :func:`widen_bf16_dot_operands` makes
the interpreter's dot widen bfloat16 operands to float32 first (exact: a bfloat16 is the top half of a
float32), then multiply and accumulate in float32, which is what a tensor core's bf16 product with an fp32
accumulator computes up to the order of its sums. Compiled kernels are untouched.
"""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _widened(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << 16  # a bfloat16 is the high 16 bits of the float32 it names
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def widen_bf16_dot_operands() -> None:
    """Make the interpreter's ``tl.dot`` multiply bfloat16 values, not their bit patterns (idempotent)."""
    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot
    if getattr(create_dot, "widens_bf16", False):
        return

    def create_dot_widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot_widened.widens_bf16 = True
    builder.create_dot = create_dot_widened
