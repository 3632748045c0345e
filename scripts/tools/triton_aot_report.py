"""Compile every Triton kernel of ``loraplex_kernels/`` for sm_80 and sm_90 in each dtype its launcher accepts.

No GPU needed: Triton's compiler and the wheel's ``ptxas`` build the cubins, the wheel's ``cuobjdump``
reads their registers. Prints one row per kernel × target × dtype (registers per thread, shared memory
per program, stack bytes per thread, 2-byte global loads in the PTX, compile seconds, the compiler's message
on failure); exits 1 if any
kernel failed to compile or has no launch spec. Triton's cache goes to a fresh temporary folder unless
TRITON_CACHE_DIR is set, so every kernel is compiled, not read back.

    python -m scripts.tools.triton_aot_report            # a table
    python -m scripts.tools.triton_aot_report --json     # one JSON list of rows
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: under it triton.jit defines interpreter functions, which do not compile")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache:
        os.environ.setdefault("TRITON_CACHE_DIR", cache)
        from loraplex_kernels.triton_aot import compile_all  # after the cache folder is set: triton reads it then

        results = compile_all()
    if args.json:
        print(json.dumps([dataclasses.asdict(result) for result in results]))
    else:
        print_table(results)
    return 0 if all(result.ok for result in results) else 1


def print_table(results: list) -> None:
    header = (
        f"{'kernel':<60} {'target':<6} {'dtype':<8} {'regs':>4} {'shared':>6} {'stack':>5} {'narrow':>6} {'seconds':>7}"
    )
    print(header)
    for r in results:
        if r.ok:
            print(
                f"{r.kernel:<60} {r.target:<6} {r.dtype:<8} {r.registers:>4} {r.shared_bytes:>6} "
                f"{r.stack_bytes:>5} {r.narrow_loads:>6} {r.compile_seconds:>7.2f}"
            )
        else:
            print(f"{r.kernel:<60} {r.target:<6} {r.dtype:<8} FAILED: {r.error}")


if __name__ == "__main__":
    sys.exit(main())
