"""CPU cost of the SGMV torch implementation on a decode batch, against the dense base projection.

SmolLM2-135M's q/k/v group (in 576, outs 576/192/192, 30 layers, P = 6144) in a pool laid out as the
engine does: each adapter on its own pages, rows back to back from each page's start. A decode batch
of 64 tokens over 16 or 64 distinct adapters with ranks drawn from 8/16/32, sorted by adapter (a segment
per adapter) or, for 16 adapters, also in random order (a segment per token).
Reports medians of repeated runs: the per-step cost (metadata and plan), the per-layer shrink + expand
(layers cycled, so a layer's rows are not still cached from the last call), and the base projection
576 -> 960 as ``F.linear`` and as the engine's oneDNN-packed linear.

    python scripts/bench_sgmv_cpu.py            # one line per configuration
    python scripts/bench_sgmv_cpu.py --json     # last line: one JSON object
"""

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.linear import LinearWeight, linear
from kernels.lora_metadata import ModuleRows, build_sgmv_metadata
from kernels.sgmv_expand import sgmv_expand
from kernels.sgmv_shrink import sgmv_shrink
from kernels.sgmv_torch_plan import plan_sgmv_torch

NUM_LAYERS = 30
PAGE_SIZE = 16 * 2 * 3 * 64  # block_size 16 x K/V x 3 kv heads x head_dim 64
IN_DIM = 576
OUT_DIMS = (576, 192, 192)
NUM_TOKENS = 64
RANKS = (8, 16, 32)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call: robust to the odd slow run on a shared host."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build_pool(num_adapters: int, rng: random.Random) -> tuple[torch.Tensor, list[int], list[list[ModuleRows]]]:
    """A pool holding ``num_adapters`` adapters, each on its own pages, rows packed from page starts."""
    lengths: list[list[int]] = []  # per adapter, the length of each row in row-table order
    module_rows: list[list[ModuleRows]] = []
    num_rows = 0
    for _ in range(num_adapters):
        rank = rng.choice(RANKS)
        rows, row_lengths = [], []
        for out_dim in OUT_DIMS:
            rows.append(ModuleRows(num_rows, num_rows + rank, rank))
            row_lengths += [IN_DIM] * rank + [out_dim] * rank
            num_rows += 2 * rank
        lengths.append(row_lengths)
        module_rows.append(rows)
    row_addr, page = [], 0
    for row_lengths in lengths:
        offset = 0
        for length in row_lengths:
            if offset + length > PAGE_SIZE:
                page, offset = page + 1, 0
            row_addr.append(page * NUM_LAYERS * PAGE_SIZE + offset)
            offset += length
        page += 1
    storage = torch.randn(page, NUM_LAYERS, PAGE_SIZE) * 0.02  # [num_pages, layers, P]
    return storage, row_addr, module_rows


def measure(num_adapters: int, sort_tokens: bool, repeats: int, seed: int) -> dict[str, float]:
    """``sort_tokens``: tokens grouped by adapter (a segment per adapter), else in random adapter order
    (a segment per token, as when decode rows are ordered by context length)."""
    rng = random.Random(seed)
    storage, row_addr, module_rows = build_pool(num_adapters, rng)
    token_adapters = [rng.randrange(num_adapters) for _ in range(NUM_TOKENS - num_adapters)]
    token_adapters += list(range(num_adapters))  # every adapter at least once
    if sort_tokens:
        segments = [(token_adapters.count(a), module_rows[a]) for a in range(num_adapters)]
    else:
        rng.shuffle(token_adapters)
        segments = [(1, module_rows[a]) for a in token_adapters]

    def step_cost() -> None:
        meta = build_sgmv_metadata(segments, row_addr, IN_DIM, OUT_DIMS)
        plan_sgmv_torch(storage, meta)

    meta = build_sgmv_metadata(segments, row_addr, IN_DIM, OUT_DIMS)
    plan = plan_sgmv_torch(storage, meta)
    x = torch.randn(NUM_TOKENS, IN_DIM)  # [num_tokens, in_dim]
    y = torch.randn(NUM_TOKENS, sum(OUT_DIMS))  # [num_tokens, 960]
    layers = iter(range(10**9))

    v = sgmv_shrink(x, storage, meta, 0, plan)  # [num_tokens, v_width]

    def lora_layer() -> None:
        offset = next(layers) % NUM_LAYERS * PAGE_SIZE
        sgmv_expand(sgmv_shrink(x, storage, meta, offset, plan), storage, meta, offset, y, plan)

    def lora_layer_unplanned() -> None:
        offset = next(layers) % NUM_LAYERS * PAGE_SIZE
        v = sgmv_shrink(x, storage, meta, offset)
        sgmv_expand(v, storage, meta, offset, y)

    weight = torch.randn(sum(OUT_DIMS), IN_DIM) * 0.02  # [960, 576]
    packed = LinearWeight.prepare(weight)
    return {
        "num_adapters": num_adapters,
        "segments": len(segments),
        "metadata_ms": median_ms(lambda: build_sgmv_metadata(segments, row_addr, IN_DIM, OUT_DIMS), repeats),
        "metadata_and_plan_ms": median_ms(step_cost, repeats),
        "shrink_expand_per_layer_ms": median_ms(lora_layer, repeats * NUM_LAYERS),
        "shrink_per_layer_ms": median_ms(
            lambda: sgmv_shrink(x, storage, meta, next(layers) % NUM_LAYERS * PAGE_SIZE, plan), repeats * NUM_LAYERS
        ),
        "expand_per_layer_ms": median_ms(
            lambda: sgmv_expand(v, storage, meta, next(layers) % NUM_LAYERS * PAGE_SIZE, y, plan), repeats * NUM_LAYERS
        ),
        "shrink_expand_unplanned_per_layer_ms": median_ms(lora_layer_unplanned, repeats),
        "dense_f_linear_ms": median_ms(lambda: F.linear(x, weight), repeats * NUM_LAYERS),
        "dense_packed_linear_ms": median_ms(lambda: linear(x, packed), repeats * NUM_LAYERS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(16, True), (16, False), (64, True)]
    results = [measure(num_adapters, sort_tokens, args.repeats, args.seed) for num_adapters, sort_tokens in configs]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))
        return
    for result in results:
        print(
            "  ".join(
                f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}" for key, value in result.items()
            )
        )


if __name__ == "__main__":
    main()
