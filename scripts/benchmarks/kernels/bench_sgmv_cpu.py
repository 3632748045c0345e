"""CPU cost of the SGMV torch implementation on a decode batch, against the dense base projection.

SmolLM2-135M's q/k/v group (in 576, outs 576/192/192, 30 layers, P = 6144) in a pool laid out as the
engine does: each adapter on its own pages, rows back to back from each page's start. A decode batch
of 64 tokens over 16 or 64 distinct adapters with ranks drawn from 8/16/32, sorted by adapter (a segment
per adapter) or, for 16 adapters, also in random order (a segment per token).
Reports medians of repeated runs: the per-step cost (metadata and plan), the per-layer shrink + expand
(layers cycled, so a layer's rows are not still cached from the last call), and the base projection
576 -> 960 as ``F.linear`` and as the engine's oneDNN-packed linear.

``--pages`` measures the native fused op (the engine's on CPU) on float32 adapter pages against bf16 pages
(bf16 mode's pool): a decode step's LoRA of every layer of the configured model (the default model's 30)
and the four projection groups, through the
engine's own layout, packing and step tables, rank-8/16/32 adapters on every projection. Both pools hold
the same values (the float32 pool holds the bf16 rows widened), rounds alternate the two, and each step
reports both medians (wall and CPU time), the speedup and the largest difference of the outputs; then
rank-8 and rank-16 adapters per GiB of pool in each dtype.

    python -m scripts.benchmarks.kernels.bench_sgmv_cpu            # one line per configuration
    python -m scripts.benchmarks.kernels.bench_sgmv_cpu --json     # last line: one JSON object
    python -m scripts.benchmarks.kernels.bench_sgmv_cpu --pages --json
"""

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from app.model_store import resolve_model
from app.settings import Settings
from engine.adapters.adapter_cache import AdapterEntry
from engine.adapters.adapter_layout import pack_pages, pages_for_rank, plan_layout
from engine.adapters.lora_adapter import LoraAdapter, LoraWeights
from engine.adapters.lora_batch import MODULE_GROUPS, LoraStep, build_lora_step
from engine.adapters.lora_config import PROJECTIONS, projection_shapes
from engine.config import ModelConfig
from engine.memory.page_pool import page_bytes
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import LinearWeight, linear
from loraplex_kernels.sgmv.lora_metadata import ModuleRows, build_sgmv_metadata
from loraplex_kernels.sgmv.sgmv_expand import sgmv_expand
from loraplex_kernels.sgmv.sgmv_shrink import sgmv_shrink
from loraplex_kernels.sgmv.sgmv_torch_plan import plan_sgmv_torch

NUM_LAYERS = 30
PAGE_SIZE = 16 * 2 * 3 * 64  # block_size 16 x K/V x 3 kv heads x head_dim 64
IN_DIM = 576
OUT_DIMS = (576, 192, 192)
NUM_TOKENS = 64
RANKS = (8, 16, 32)
PAGE_STEPS = ((64, 16), (64, 1), (8, 8))  # (decode tokens, adapters) of the --pages steps
CAPACITY_RANKS = (8, 16)


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


def random_adapter(cfg: ModelConfig, rank: int, gen: torch.Generator) -> LoraAdapter:
    """A rank-``rank`` LoRA on every projection, A rows of unit norm and B of LoRA-like scale."""
    shapes = projection_shapes(cfg)
    layers = tuple(
        {
            module: LoraWeights(
                a=torch.randn(rank, in_dim, generator=gen) / in_dim**0.5,  # [rank, in]
                b=torch.randn(out_dim, rank, generator=gen) * 0.02,  # [out, rank]
            )
            for module, (in_dim, out_dim) in shapes.items()
        }
        for _ in range(cfg.num_layers)
    )
    ranks = dict.fromkeys(PROJECTIONS, rank)
    return LoraAdapter(f"bench-{rank}", 0, PROJECTIONS, ranks, layers, float(rank), False, None)


def adapter_pools(
    cfg: ModelConfig, num_adapters: int, rng: random.Random
) -> tuple[dict[str, torch.Tensor], list[AdapterEntry]]:
    """``num_adapters`` adapters placed as the engine places them, one after another: the bf16 pool and a
    float32 pool holding the same values, [num_pages, num_layers, P] each; the adapters' entries (resident)."""
    page_elems = cfg.page_elems(cfg.pick_block_size())
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    entries, images = [], []
    for index in range(num_adapters):
        adapter = random_adapter(cfg, rng.choice(RANKS), gen)
        layout = plan_layout(adapter, cfg, page_elems)
        first = sum(image.shape[0] for image in images)
        images.append(pack_pages(adapter, layout, cfg.num_layers, page_elems, torch.bfloat16))  # [pages, L, P]
        page_ids = list(range(first, first + layout.num_pages))
        row_addr = layout.row_addr(page_ids, cfg.num_layers, page_elems)  # [num_rows]
        entries.append(
            AdapterEntry(
                name=f"a{index}",
                path=Path(),
                digest=str(index),
                modules=PROJECTIONS,
                ranks=adapter.ranks,
                layout=layout,
                host_bytes=0,
                host=None,
                page_ids=page_ids,
                row_addr=row_addr,
                row_addr_list=row_addr.tolist(),
            )
        )
    bf16 = torch.cat(images)  # [num_pages, L, P]
    return {"fp32": bf16.float(), "bf16": bf16}, entries


def lora_step_ms(
    step: LoraStep, xs: dict[str, torch.Tensor], ys: dict[str, torch.Tensor], storage: torch.Tensor, clock
) -> float:
    """A decode step's LoRA: each group's fused op at every layer, as the model runs it; ms on ``clock``."""
    start = clock()
    for layer in range(storage.shape[1]):
        for name in MODULE_GROUPS:
            step.apply(name, xs[name], ys[name], layer, storage)
    return (clock() - start) * 1e3


def measure_pages(cfg: ModelConfig, num_tokens: int, num_adapters: int, rounds: int, seed: int) -> dict[str, float]:
    """One decode step of ``num_tokens`` tokens over ``num_adapters`` adapters (tokens sorted by adapter, each
    adapter at least once) on fp32 pages and on bf16 pages, alternated round by round."""
    rng = random.Random(seed)
    pools, entries = adapter_pools(cfg, num_adapters, rng)
    token_adapters = [*range(num_adapters), *(rng.randrange(num_adapters) for _ in range(num_tokens - num_adapters))]
    runs = [(1, entries[a]) for a in sorted(token_adapters)]  # consecutive tokens of an adapter: one segment
    shapes = projection_shapes(cfg)
    xs = {name: torch.randn(num_tokens, shapes[modules[0]][0]) for name, modules in MODULE_GROUPS.items()}
    widths = {name: sum(shapes[m][1] for m in modules) for name, modules in MODULE_GROUPS.items()}
    steps = {name: build_lora_step(runs, cfg, pool, KernelBackend.NATIVE) for name, pool in pools.items()}
    ys = {name: torch.zeros(num_tokens, width) for name, width in widths.items()}  # [tokens, group width]
    times: dict[str, list[float]] = {name: [] for name in pools}
    cpu_times: dict[str, list[float]] = {name: [] for name in pools}
    for name, pool in pools.items():  # warm-up
        lora_step_ms(steps[name], xs, ys, pool, time.perf_counter)
    for _ in range(rounds):
        for name, pool in pools.items():
            times[name].append(lora_step_ms(steps[name], xs, ys, pool, time.perf_counter))
            cpu_times[name].append(lora_step_ms(steps[name], xs, ys, pool, time.process_time))
    outputs = {}
    for name, pool in pools.items():
        outputs[name] = {group: torch.zeros(num_tokens, width) for group, width in widths.items()}
        lora_step_ms(steps[name], xs, outputs[name], pool, time.perf_counter)
    fp32_ms, bf16_ms = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    fp32_cpu, bf16_cpu = statistics.median(cpu_times["fp32"]), statistics.median(cpu_times["bf16"])
    return {
        "tokens": num_tokens,
        "adapters": num_adapters,
        "fp32_pages_mib": round(pools["fp32"].numel() * 4 / 2**20, 1),
        "fp32_pages_ms": round(fp32_ms, 2),
        "bf16_pages_ms": round(bf16_ms, 2),
        "speedup": round(fp32_ms / bf16_ms, 2),
        "fp32_pages_cpu_ms": round(fp32_cpu, 2),
        "bf16_pages_cpu_ms": round(bf16_cpu, 2),
        "cpu_speedup": round(fp32_cpu / bf16_cpu, 2),
        "max_abs_diff": max(float((outputs["fp32"][g] - outputs["bf16"][g]).abs().max()) for g in widths),
    }


def adapters_per_gib(cfg: ModelConfig) -> dict[str, int]:
    """Rank-r adapters on every projection a GiB of pool holds, with float32 and with bf16 pages."""
    block_size = cfg.pick_block_size()
    page_elems = cfg.page_elems(block_size)
    counts = {}
    for rank in CAPACITY_RANKS:
        pages = pages_for_rank(cfg, rank, page_elems)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            counts[f"{name}_rank{rank}_adapters_per_gib"] = 2**30 // (pages * page_bytes(cfg, block_size, dtype))
    return counts


def main_pages(args: argparse.Namespace) -> None:
    settings = Settings.from_env()
    cfg = ModelConfig.from_folder(Path(args.model or resolve_model(settings.model, settings.home)))
    results: dict = {"threads": torch.get_num_threads(), "rounds": args.rounds}
    for num_tokens, num_adapters in PAGE_STEPS:
        entry = measure_pages(cfg, num_tokens, num_adapters, args.rounds, args.seed)
        results[f"decode_{num_tokens}_over_{num_adapters}"] = entry
        summary = ", ".join(f"{k} {v}" for k, v in entry.items())
        sys.stdout.write(f"LoRA of a decode step ({cfg.num_layers} layers): {summary}\n")
    results.update(adapters_per_gib(cfg))
    sys.stdout.write(f"{json.dumps(results) if args.json else results}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--pages", action="store_true", help="the native op on fp32 against bf16 adapter pages")
    parser.add_argument("--rounds", type=int, default=9, help="with --pages: alternated rounds, medians reported")
    parser.add_argument(
        "--model", help="with --pages: a model folder (default: LORAPLEX_MODEL, else the default model)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pages:
        main_pages(args)
        return
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
