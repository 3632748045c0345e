"""The tests' bfloat16 tl.dot under the interpreter (tests/triton_bf16_dot.py): it multiplies values, as a tensor core
with an fp32 accumulator does, so the kernels' bf16 tests check the kernels and not the interpreter's bit patterns."""

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])  # [N, N]
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])  # [N, N]
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))  # [N, N] fp32


def test_a_bfloat16_dot_is_the_product_of_the_values_in_float32():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=generator).bfloat16()
    b = torch.randn(16, 16, generator=generator).bfloat16()
    c = torch.empty(16, 16)

    _dot_kernel[(1,)](a, b, c, N=16)

    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
