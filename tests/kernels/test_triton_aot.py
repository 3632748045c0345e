"""Every Triton kernel of ``loraplex_kernels/`` compiles ahead of time for sm_80 and sm_90 in each dtype its launcher
accepts, with the constexprs and num_warps its launcher passes.

The compile runs once, in a subprocess (``scripts/tools/triton_aot_report.py --json``) without TRITON_INTERPRET
(the test session sets it, and under it ``triton.jit`` makes interpreter functions, which do not compile) and
with a fresh Triton cache, so no cached kernel hides a compile error. The cases are found here by the same
walk of the package, so a new kernel is a new case (or a failure naming it, without a launch spec).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loraplex_kernels.triton_aot import TARGET_ARCHS, dtype_name, find_kernels, find_launches
from loraplex_kernels.triton_launch import LaunchSpecError, make_launch

ROOT = Path(__file__).resolve().parents[2]
# The whole compile takes about a minute on two cores; this bounds a hung compiler, not a slow one.
COMPILE_TIMEOUT_S = 900
# Shared memory one block may use (with the opt-in): 163 KB on sm_80 (A100), 227 KB on sm_90 (H100).
MAX_SHARED_BYTES = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
MAX_REGISTERS = 255  # per thread, on both

KERNELS = find_kernels()
LAUNCHES = find_launches()
CASES = [
    (name, f"sm_{arch}", dtype_name(launch))
    for name in sorted(LAUNCHES)
    for launch in LAUNCHES[name]
    for arch in TARGET_ARCHS
]


def compile_env(cache: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {**env, "TRITON_CACHE_DIR": str(cache)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict]:
    """The report's rows by (kernel, target, dtype), from one compile of everything."""
    result = subprocess.run(
        [sys.executable, "scripts/tools/triton_aot_report.py", "--json"],
        cwd=ROOT,
        env=compile_env(tmp_path_factory.mktemp("triton-cache")),
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    try:
        rows = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the AOT report printed no JSON (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return {(row["kernel"], row["target"], row["dtype"]): row for row in rows}


def test_the_walk_finds_the_kernels_and_every_dtype():
    short = {name.rsplit(".", 1)[1] for name in KERNELS}
    assert {"_sgmv_shrink_kernel", "_sgmv_expand_kernel", "_paged_attention_kernel"} <= short
    assert "_paged_prefill_attention_kernel" in short
    assert "load_kv_tile" not in short, "a device function the kernels call is not a kernel of its own"
    for name, launches in LAUNCHES.items():
        assert sorted(dtype_name(launch) for launch in launches) == ["bfloat16", "float16", "float32"], name


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_has_a_launch_spec(kernel: str):
    assert kernel in LAUNCHES, (
        f"{kernel} has no launch spec: its module's triton_launches() must list its launches "
        "(see loraplex_kernels/triton_launch.py)"
    )


@pytest.mark.parametrize(("kernel", "target", "dtype"), CASES)
def test_kernel_compiles(compiled: dict, kernel: str, target: str, dtype: str):
    row = compiled.get((kernel, target, dtype))
    assert row is not None, f"the compile subprocess did not build {kernel} for {target} in {dtype}"
    assert row["ok"], f"{kernel} does not compile for {target} in {dtype}:\n{row['error']}"
    assert 0 < row["registers"] <= MAX_REGISTERS
    # Every kernel stages its tiles through shared memory; a tile too big for the target does not launch.
    assert 0 < row["shared_bytes"] <= MAX_SHARED_BYTES[target], f"{kernel} needs {row['shared_bytes']} B of shared"
    assert isinstance(row["stack_bytes"], int), "the cubin's stack frame was not read"
    if dtype != "float32":  # tiles of 16-bit values read 16 bytes a load, as the engine's strides and tables allow
        assert row["narrow_loads"] == 0, f"{kernel} reads {row['narrow_loads']} 2-byte values a load in {dtype}"


def test_the_compile_subprocess_found_the_same_kernels(compiled: dict):
    assert {kernel for kernel, _, _ in compiled} == set(KERNELS)


def test_a_launch_spec_must_name_every_parameter():
    launch = LAUNCHES[min(LAUNCHES)][0]
    arg_types = {name: kind for name, kind in launch.signature.items() if kind != "constexpr"}
    first = next(iter(arg_types))
    dropped = {name: kind for name, kind in arg_types.items() if name != first}

    with pytest.raises(LaunchSpecError, match=re.escape(f"untyped ['{first}']")):
        make_launch(launch.kernel, launch.dtype, dropped, launch.constexprs, launch.num_warps)
    with pytest.raises(LaunchSpecError, match=re.escape("not parameters ['extra']")):
        make_launch(launch.kernel, launch.dtype, {**arg_types, "extra": "i32"}, launch.constexprs, launch.num_warps)


# A kernel whose tl.dot has an inner dimension of 8, which the interpreter runs and the compiler rejects
# (NVIDIA's tensor-core products take K >= 16 for 16-bit inputs).
_BROKEN_KERNEL = textwrap.dedent(
    """
    import json, torch, triton, triton.language as tl
    from loraplex_kernels.triton_aot import compile_launch
    from loraplex_kernels.triton_launch import make_launch

    @triton.jit
    def _short_k_dot(x_ptr, K: tl.constexpr):
        r = tl.arange(0, 16)
        k = tl.arange(0, K)
        x = tl.load(x_ptr + r[:, None] * K + k[None, :])
        y = tl.load(x_ptr + k[:, None] * 16 + r[None, :])
        tl.store(x_ptr + r[:, None] * 16 + r[None, :], tl.dot(x, y).to(tl.float16))

    launch = make_launch(_short_k_dot, torch.float16, {"x_ptr": "*fp16"}, {"K": 8}, 4)
    result = compile_launch(launch, 80)
    print(json.dumps({"ok": result.ok, "target": result.target, "dtype": result.dtype, "error": result.error}))
    """
)


def test_a_kernel_that_does_not_compile_fails_with_the_compiler_message(tmp_path: Path):
    script = tmp_path / "short_k_dot.py"  # triton.jit reads a kernel's source from its file
    script.write_text(_BROKEN_KERNEL)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=compile_env(tmp_path / "triton-cache"),
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    row = json.loads(result.stdout.splitlines()[-1])
    assert not row["ok"] and row["target"] == "sm_80" and row["dtype"] == "float16"
    assert "K >= 16" in row["error"], row["error"]
