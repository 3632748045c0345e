"""How a launcher launches a Triton kernel, in one place: what the launch passes and what the AOT compile builds.

Each kernel module describes its launch per dtype with ``TritonLaunch`` (the constexprs and ``num_warps`` its
launcher passes, the Triton type of every parameter), its launcher reads the constexprs and ``num_warps``
from that object, and its ``triton_launches()`` lists the launches for every dtype it accepts, so the
ahead-of-time compile (``loraplex_kernels.triton_aot``) builds exactly what runs and cannot drift from it.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Triton's name of each element type a launcher accepts, as in a pointer's signature type ("*bf16").
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The model shape the attention kernels' constexprs depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


# The attention kernels are compiled per model shape; the AOT compile builds them at SmolLM2-135M's (the
# default model): 9 query heads over 3 kv heads, head_dim 64, pages of 16 tokens.
AOT_ATTENTION_SHAPE = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)

# The stride parameters both paged attention kernels take (each an ``i32``).
ATTENTION_STRIDE_ARGS = (
    "stride_q_token",
    "stride_q_head",
    "stride_kv_page",
    "stride_kv_kind",
    "stride_kv_slot",
    "stride_kv_head",
    "stride_out_token",
    "stride_out_head",
    "stride_bt_seq",
    "stride_bt_block",
)


class LaunchSpecError(ValueError):
    """A launch spec does not fit its kernel (a parameter without a type, or typed twice)."""


@dataclass(frozen=True, slots=True)
class TritonLaunch:
    """One kernel launched for one dtype: what its launcher passes besides the tensors and scalars.

    ``kernel`` is the ``@triton.jit`` object (a ``JITFunction``; an ``InterpretedFunction`` under
    ``TRITON_INTERPRET=1``). ``signature`` gives every parameter's Triton type as the runtime would infer
    it from the launcher's arguments: ``"*fp16"`` for a tensor, ``"i32"`` / ``"i64"`` for an int,
    ``"fp32"`` for a float, ``"constexpr"`` for the parameters in ``constexprs``.
    """

    kernel: Any
    dtype: torch.dtype
    signature: Mapping[str, str]
    constexprs: Mapping[str, int | str]
    num_warps: int

    @property
    def kernel_name(self) -> str:
        return kernel_name(self.kernel)

    def options(self) -> dict[str, int]:
        """What the launcher passes besides the arguments: ``num_warps``, or the options a tuning run set."""
        tuned = _TUNED.get(self.kernel)
        if tuned is None:
            return {"num_warps": self.num_warps}
        return {"num_warps": tuned.num_warps} | ({"num_stages": tuned.num_stages} if tuned.num_stages else {})


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """A kernel's launch options other than its launch spec's, as a tuning run tries them."""

    num_warps: int
    num_stages: int | None = None  # None: Triton's default for the target


_TUNED: dict[Any, LaunchOptions] = {}  # by kernel object: what tuned_launch set, for the block it runs


@contextmanager
def tuned_launch(kernel: Any, options: LaunchOptions) -> Iterator[None]:
    """Launch ``kernel`` (a ``@triton.jit`` object) with ``options`` inside the block, whatever its launch spec says.

    For a tuning sweep (``scripts/benchmarks/kernels/bench_triton_kernels.py``): the launchers read their options
    through ``TritonLaunch.options``, so the kernel runs as the engine launches it but for these options.
    """
    previous = _TUNED.get(kernel)
    _TUNED[kernel] = options
    try:
        yield
    finally:
        if previous is None:
            del _TUNED[kernel]
        else:
            _TUNED[kernel] = previous


def kernel_name(kernel: Any) -> str:
    """A ``@triton.jit`` kernel's ``module.function``: ``loraplex_kernels.sgmv.sgmv_shrink._sgmv_shrink_kernel``."""
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


def triton_type(dtype: torch.dtype) -> str:
    """Triton's name of a launcher's element type: ``torch.bfloat16`` -> ``"bf16"``."""
    if dtype not in _TRITON_TYPES:
        raise LaunchSpecError(f"no Triton kernel here takes {dtype}; they take {list(_TRITON_TYPES)}")
    return _TRITON_TYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: "ieee" for fp32 (tf32 would miss the tests' 1e-4), ignored for bf16/fp16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def make_launch(
    kernel: Any,
    dtype: torch.dtype,
    arg_types: Mapping[str, str],
    constexprs: Mapping[str, int | str],
    num_warps: int,
) -> TritonLaunch:
    """A ``TritonLaunch`` whose signature is ``arg_types`` plus ``"constexpr"`` for each of ``constexprs``.

    Raises ``LaunchSpecError`` unless the two name every parameter of ``kernel`` exactly once, so a
    parameter added to a kernel without its spec fails here, in the launcher and in the AOT test alike.
    """
    typed = set(arg_types) | set(constexprs)
    params = list(kernel.arg_names)
    missing = [name for name in params if name not in typed]
    unknown = sorted(typed - set(params))
    both = sorted(set(arg_types) & set(constexprs))
    if missing or unknown or both:
        raise LaunchSpecError(
            f"launch spec of {kernel_name(kernel)} does not fit its parameters: "
            f"untyped {missing}, not parameters {unknown}, typed and constexpr {both}"
        )
    signature = {name: arg_types.get(name, "constexpr") for name in params}
    return TritonLaunch(kernel, dtype, signature, dict(constexprs), num_warps)
