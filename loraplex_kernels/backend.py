"""Which implementation the ops run: the engine resolves its ``kernels`` setting to one of these once."""

import enum

import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex_kernels.triton_aot import find_kernels


class KernelBackend(enum.Enum):
    """The ops' implementation; each op's dispatcher runs what the backend names, on any device."""

    TORCH = "torch"  # torch ops (the implementations beside each kernel)
    NATIVE = "native"  # the C++ CPU library in loraplex_kernels/csrc, loaded by loraplex_kernels.native_cpu
    TRITON = "triton"  # the Triton kernels where an op has one (paged attention, SGMV), torch ops for the rest


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (a phrase for an error message), or None when they can.

    On CUDA they compile. On CPU they run only under Triton's interpreter, which ``triton.jit`` chooses
    when a kernel is defined (it reads TRITON_INTERPRET then): so this looks at the kernel objects
    themselves, not at the environment, and names the ones defined for the compiler.
    """
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"they run on CUDA, or on CPU under Triton's interpreter, not on {device.type}"
    compiled = compiled_triton_functions()
    if not compiled:
        return None
    return (
        f"on CPU they run under Triton's interpreter, but {', '.join(compiled)} "
        f"{'was' if len(compiled) == 1 else 'were'} defined for the compiler; set TRITON_INTERPRET=1 in the "
        "environment before anything imports the kernels (triton reads it when a kernel is defined)"
    )


def compiled_triton_functions() -> list[str]:
    """Qualified names of the Triton kernels in this package that are not interpreter functions.

    The kernels are found by walking the package (the AOT compile's walk), so a kernel added in a new file
    is checked too.
    """
    return sorted(name for name, kernel in find_kernels().items() if not isinstance(kernel, InterpretedFunction))
