"""Which implementation the ops run: the engine resolves its ``kernels`` setting to one of these once."""

import enum


class KernelBackend(enum.Enum):
    """The ops' implementation on CPU; on CUDA every op runs its Triton kernel (or torch) whatever this says."""

    TORCH = "torch"  # torch ops (the implementations beside each kernel)
    NATIVE = "native"  # the C++ CPU library in kernels/csrc, loaded by kernels.native_cpu
