"""The Triton kernels of a decode step, each timed alone at bench_gpu's shape, and a sweep of their launch options.

On a CUDA machine each kernel runs as the engine launches it, on 256 decode rows of bench_gpu's llama-1b shape
(32 query heads over 8 kv heads, head_dim 64, contexts of 128 to 256 keys in pages of 16 tokens; 16 adapters of
rank 16 on every projection, 16 rows each): the row attention kernel, and the SGMV shrink and expand of the
q/k/v, gate/up and down groups (one layer each). Reported per kernel: the median time of a call (Triton's
``do_bench``, which empties the L2 cache before each call), the bytes it must move (every tensor it reads or
writes counted once) and the bandwidth that makes (``gbs``; the device's is --bandwidth-gbs, ``of_peak`` the
fraction). ``--sweep`` times each kernel again for every ``num_warps`` × ``num_stages`` of SWEEP_WARPS ×
SWEEP_STAGES (``loraplex_kernels.triton_launch.tuned_launch``) and reports the fastest beside the launch spec's.

``--quick`` runs tiny shapes on a CPU under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are
imported): each call once, timed by the wall clock, so its figures mean nothing; it keeps the script tested.

    python -m scripts.benchmarks.kernels.bench_triton_kernels --sweep --json            # CUDA; last line: JSON
    TRITON_INTERPRET=1 python -m scripts.benchmarks.kernels.bench_triton_kernels --quick --sweep --json
"""

import argparse
import dataclasses
import itertools
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.adapters.adapter_layout import ROW_ALIGN
from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_attention_triton import _paged_attention_kernel, paged_attention_triton
from loraplex_kernels.backend import triton_unavailable_reason
from loraplex_kernels.sgmv.lora_metadata import ModuleRows, SgmvMetadata, build_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_expand import _sgmv_expand_kernel, expand_partials
from loraplex_kernels.sgmv.sgmv_shrink import _sgmv_shrink_kernel, shrink_partials
from loraplex_kernels.triton_launch import LaunchOptions, tuned_launch
from scripts.benchmarks.engine.bench_gpu import ADAPTER_RANK, NUM_ROWS, SHAPES

logger = logging.getLogger("bench_triton_kernels")

SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (1, 2, 3, 4)
NUM_ADAPTERS = 16
BLOCK_SIZE = 16
CONTEXT = (128, 256)  # keys of a row, drawn uniformly: bench_gpu's decode steps, 128 prompt + 0..128 output tokens


@dataclass(frozen=True, slots=True)
class Shape:
    """What the kernels' inputs are sized by."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    rows: int
    adapters: int
    rank: int
    context: tuple[int, int]


QUICK_SHAPE = Shape(
    hidden=64, heads=4, kv_heads=2, intermediate=128, head_dim=16, rows=8, adapters=2, rank=4, context=(20, 40)
)


def full_shape() -> Shape:
    hidden, _, heads, kv_heads, intermediate, _ = SHAPES["llama-1b"]
    return Shape(hidden, heads, kv_heads, intermediate, hidden // heads, NUM_ROWS, NUM_ADAPTERS, ADAPTER_RANK, CONTEXT)


@dataclass(frozen=True, slots=True)
class Case:
    """One kernel call: what runs it, the ``@triton.jit`` object it launches, and the bytes it must move.

    ``call`` is what is timed; ``result`` runs it once from the same inputs and returns what it computed, so a
    sweep's options can be checked against the launch spec's.
    """

    name: str
    kernel: object
    call: Callable[[], object]
    result: Callable[[], torch.Tensor]
    bytes_moved: int


def attention_case(shape: Shape, dtype: torch.dtype, device: torch.device, rng: random.Random) -> Case:
    """The row kernel over ``shape.rows`` decode rows, their pages shuffled through the pool."""
    seq_lens = [rng.randint(*shape.context) for _ in range(shape.rows)]
    blocks = [-(-length // BLOCK_SIZE) for length in seq_lens]
    pages = list(range(sum(blocks)))
    rng.shuffle(pages)
    max_blocks = max(blocks)
    table = torch.zeros(shape.rows, max_blocks, dtype=torch.int32)  # [rows, max_blocks]
    start = 0
    for row, count in enumerate(blocks):
        table[row, :count] = torch.tensor(pages[start : start + count], dtype=torch.int32)
        start += count
    kv = torch.randn(len(pages), 2, BLOCK_SIZE, shape.kv_heads, shape.head_dim, dtype=dtype, device=device)
    q = torch.randn(shape.rows, shape.heads, shape.head_dim, dtype=dtype, device=device)  # [rows, heads, head_dim]
    query_start_loc = tuple(range(shape.rows + 1))
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        token_to_seq=torch.arange(shape.rows, dtype=torch.int32, device=device),
        num_decode_seqs=shape.rows,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_list=query_start_loc,
        seq_lens_list=tuple(seq_lens),
    )
    element = dtype.itemsize
    kv_bytes = sum(seq_lens) * 2 * shape.kv_heads * shape.head_dim * element
    bytes_moved = kv_bytes + 2 * q.numel() * element + table.numel() * 4
    scale = shape.head_dim**-0.5

    def call() -> torch.Tensor:
        return paged_attention_triton(q, kv, meta, scale)  # [rows, heads, head_dim]

    return Case("attention", _paged_attention_kernel, call, call, bytes_moved)


def sgmv_cases(
    group: str, in_dim: int, out_dims: tuple[int, ...], shape: Shape, dtype: torch.dtype, device: torch.device
) -> list[Case]:
    """The shrink and the expand of one module group: ``shape.adapters`` adapters, ``shape.rows`` rows spread evenly."""
    row_dims = [in_dim] * len(out_dims) + list(out_dims)  # per adapter: each module's A rows, then its Bᵀ rows
    row_addr: list[int] = []
    segments = []
    offset = 0
    for _ in range(shape.adapters):
        first = len(row_addr)
        for dim in row_dims:
            for _ in range(shape.rank):
                row_addr.append(offset)
                offset += -(-dim // ROW_ALIGN) * ROW_ALIGN  # rows start where the engine's layout starts them
        num_modules = len(out_dims)
        modules = [
            ModuleRows(first + m * shape.rank, first + (num_modules + m) * shape.rank, shape.rank)
            for m in range(num_modules)
        ]
        segments.append((shape.rows // shape.adapters, modules))
    meta: SgmvMetadata = build_sgmv_metadata(segments, row_addr, in_dim, out_dims, device=device)
    storage = torch.randn(1, 1, offset, dtype=dtype, device=device) * 0.02  # [pages, layers, P]
    x = torch.randn(meta.num_tokens, in_dim, dtype=dtype, device=device)  # [rows, in_dim]
    y = torch.zeros(meta.num_tokens, meta.y_width, dtype=dtype, device=device)  # [rows, y_width]
    partials = shrink_partials(x, storage, meta, 0)  # [num_splits, rows, v_width]
    element = dtype.itemsize
    a_bytes = shape.adapters * shape.rank * in_dim * len(out_dims) * element
    b_bytes = shape.adapters * shape.rank * sum(out_dims) * element
    partial_bytes = partials.numel() * 4

    def shrink() -> torch.Tensor:
        return shrink_partials(x, storage, meta, 0, zeroed=False)  # [num_splits, rows, v_width]

    def expand() -> None:
        expand_partials(partials, storage, meta, 0, y)  # adds into y: each timed call adds once more

    def expanded() -> torch.Tensor:
        y.zero_()
        expand()
        return y.clone()  # [rows, y_width]

    return [
        Case(
            f"sgmv_shrink {group}", _sgmv_shrink_kernel, shrink, shrink, a_bytes + x.numel() * element + partial_bytes
        ),
        Case(
            f"sgmv_expand {group}",
            _sgmv_expand_kernel,
            expand,
            expanded,
            b_bytes + 2 * y.numel() * element + partial_bytes,
        ),
    ]


def make_cases(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list[Case]:
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [
        attention_case(shape, dtype, device, random.Random(seed)),
        *sgmv_cases("qkv", shape.hidden, (q_width, kv_width, kv_width), shape, dtype, device),
        *sgmv_cases("gate_up", shape.hidden, (shape.intermediate, shape.intermediate), shape, dtype, device),
        *sgmv_cases("down", shape.intermediate, (shape.hidden,), shape, dtype, device),
    ]


def time_ms(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median milliseconds of a call: Triton's do_bench on CUDA (L2 emptied before each), the wall clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(call, warmup=10, rep=repeats, return_mode="median")
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def measure(case: Case, device: torch.device, repeats: int, bandwidth_gbs: float) -> dict:
    ms = time_ms(case.call, device, repeats)
    gbs = case.bytes_moved / (ms / 1000) / 1e9
    return {"ms": round(ms, 4), "gbs": round(gbs, 1), "of_peak": round(gbs / bandwidth_gbs, 3)}


def sweep(case: Case, device: torch.device, repeats: int, bandwidth_gbs: float) -> list[dict]:
    """The case for every num_warps × num_stages, each result's largest difference from the launch spec's
    (``max_diff``); a combination the compiler rejects is reported with its error."""
    expected = case.result().float()
    rows = []
    for num_warps, num_stages in itertools.product(SWEEP_WARPS, SWEEP_STAGES):
        row: dict = {"num_warps": num_warps, "num_stages": num_stages}
        try:
            with tuned_launch(case.kernel, LaunchOptions(num_warps, num_stages)):
                row["max_diff"] = float((case.result().float() - expected).abs().max())
                row |= measure(case, device, repeats, bandwidth_gbs)
        except Exception as error:  # out of shared memory or registers for this combination: a result, not a stop
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on a CPU, under Triton's interpreter")
    parser.add_argument("--sweep", action="store_true", help="time every num_warps x num_stages too")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=100, help="milliseconds do_bench spends on each timing")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="the device's memory bandwidth (H200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    if args.quick:
        device, shape = torch.device("cpu"), QUICK_SHAPE
    elif torch.cuda.is_available():
        device, shape = torch.device("cuda"), full_shape()
    else:
        parser.error("no CUDA device: run on a GPU, or --quick on a CPU under TRITON_INTERPRET=1")
    reason = triton_unavailable_reason(device)
    if reason is not None:
        parser.error(f"the Triton kernels cannot run here: {reason}")
    torch.manual_seed(args.seed)
    cases = make_cases(shape, getattr(torch, args.dtype), device, args.seed)
    results = []
    for case in cases:
        case.call()  # compiled (and checked) before it is timed
        result = {"kernel": case.name, "mbytes": round(case.bytes_moved / 1e6, 3)}
        result |= measure(case, device, args.repeats, args.bandwidth_gbs)
        if args.sweep:
            tried = sweep(case, device, args.repeats, args.bandwidth_gbs)
            timed = [row for row in tried if "ms" in row]
            result["sweep"] = tried
            result["best"] = min(timed, key=lambda row: row["ms"]) if timed else None
        logger.info("%-20s %8.4f ms %8.1f GB/s", case.name, result["ms"], result["gbs"])
        results.append(result)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "dtype": args.dtype,
        "shape": dataclasses.asdict(shape),
        "bandwidth_gbs": args.bandwidth_gbs,
        "kernels": results,
    }
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
