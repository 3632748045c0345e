"""CPU cost of paged attention per step: the native op against the torch implementation.

SmolLM2-135M's shapes (9 heads, 3 kv heads, head_dim 64, block_size 16, 30 layers) in a pool laid out
and allocated as the engine's (``[num_pages, num_layers, P]`` on transparent huge pages where Linux gives
them, each sequence's pages scattered over the pool). Two steps, as bench_vllm_cpu.py's workload makes
them:

- decode: 64 rows, contexts drawn from 64 to 200 tokens;
- prefill: 4 to 8 chunks totalling 512 rows, each chunk the end of a context of up to 2x its length
  (a chunk that starts mid-prompt reads the earlier chunks' keys);
- long_prefill: one chunk of 512 rows ending a 3072-token prompt (the last chunk of a long prompt).

A step is one attention call per layer over all 30 layers (each layer reads its own slice of the pool,
as the model does). The torch path gets the decode buckets planned once per step, as the engine builds
them. Both paths run in alternating rounds on the same inputs, and the native op a third time on bf16
pages of the same values rounded (``native_bf16_ms``, ``bf16_speedup`` = native ÷ native_bf16: the bf16
mode's pool); medians of the rounds are
reported. The host is shared, so single rounds are noisy.

``--kv`` compares the native op on float32 K/V pages with the same op on bfloat16 pages (bf16 mode's
pool): a decode step of KV_ROWS rows at each context length of KV_CONTEXTS, both pools holding the same
values (the fp32 pool rounded), alternated round by round; each length reports both medians, the
speedup and the largest difference of the outputs. Each pool also runs the same step with every
sequence's blocks on one page (``..._cached_ms``: the same keys' count and arithmetic, the K/V in cache),
so the step's time splits into what the arithmetic costs and what waiting for memory adds;
``..._gb_s`` is the K/V bytes a streamed step reads per second of its wall time.

    python -m scripts.benchmarks.kernels.bench_attention_cpu --json     # last line: one JSON object
    python -m scripts.benchmarks.kernels.bench_attention_cpu --kv --json
"""

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time

import torch

from engine.memory.host_memory import zeros_on_huge_pages
from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata, plan_decode_buckets
from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import native_ops, unavailable_reason

NUM_LAYERS = 30
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
BLOCK_SIZE = 16
DECODE_ROWS = 64
PREFILL_ROWS = 512
LONG_CONTEXT = 3072
KV_ROWS = 16  # decode rows of the --kv steps: 16 x 2048 tokens x 30 layers is 1.5 GB of fp32 K/V
KV_CONTEXTS = (256, 1024, 2048)


def make_step(
    seqs: list[tuple[int, int]], rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """q, the pool and the metadata for sequences of (query rows, context length), decode rows first."""
    blocks = [-(-seq_len // BLOCK_SIZE) for _, seq_len in seqs]
    num_pages = sum(blocks) + 8
    page_ids = list(range(num_pages))
    rng.shuffle(page_ids)
    max_blocks = max(blocks)
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)  # [num_seqs, max_blocks]
    taken = 0
    for s, num_blocks in enumerate(blocks):
        table[s, :num_blocks] = torch.tensor(page_ids[taken : taken + num_blocks], dtype=torch.int32)
        taken += num_blocks
    page_elems = BLOCK_SIZE * 2 * NUM_KV_HEADS * HEAD_DIM
    storage = on_huge_pages(torch.randn(num_pages, NUM_LAYERS, page_elems))  # [num_pages, layers, P]
    q_lens = [q_len for q_len, _ in seqs]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM)  # [num_tokens, heads, head_dim]
    num_decode = sum(q_len == 1 for q_len in q_lens)
    seq_lens = [seq_len for _, seq_len in seqs]
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # [num_seqs + 1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [num_seqs]
        block_tables=table,
        token_to_seq=torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32), torch.tensor(q_lens)),
        num_decode_seqs=num_decode,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_list=tuple(starts),
        seq_lens_list=tuple(seq_lens),
    )
    return q, storage, meta


def on_huge_pages(values: torch.Tensor) -> torch.Tensor:
    """``values`` in memory allocated as the engine allocates its pool (advised for transparent huge pages)."""
    pool, _ = zeros_on_huge_pages(tuple(values.shape), values.dtype)
    return pool.copy_(values)


def decode_seqs(rng: random.Random) -> list[tuple[int, int]]:
    return sorted(((1, rng.randint(64, 200)) for _ in range(DECODE_ROWS)), key=lambda s: s[1])


def prefill_seqs(rng: random.Random) -> list[tuple[int, int]]:
    num_chunks = rng.randint(4, 8)
    cuts = sorted(rng.sample(range(1, PREFILL_ROWS), num_chunks - 1))
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, PREFILL_ROWS], strict=True)]
    return [(q_len, q_len + rng.randint(0, q_len)) for q_len in lens]


def long_prefill_seqs(rng: random.Random) -> list[tuple[int, int]]:
    return [(PREFILL_ROWS, LONG_CONTEXT)]


SEQS = {"decode": decode_seqs, "prefill": prefill_seqs, "long_prefill": long_prefill_seqs}


def step_ms(
    q: torch.Tensor,
    storage: torch.Tensor,
    meta: PagedAttentionMetadata,
    backend: KernelBackend,
    clock=time.perf_counter,
) -> float:
    """One step: an attention call per layer, each reading its own layer of the pool; ms on ``clock``."""
    num_pages = storage.shape[0]
    start = clock()
    for layer in range(NUM_LAYERS):
        kv = storage[:, layer].view(num_pages, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # [pages, 2, bs, kvh, D]
        paged_attention(q, kv, meta, HEAD_DIM**-0.5, backend)
    return (clock() - start) * 1e3


def measure(kind: str, rounds: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    seqs = SEQS[kind](rng)
    q, storage, meta = make_step(seqs, rng)
    torch_meta = dataclasses.replace(
        meta,
        decode_buckets=plan_decode_buckets(
            meta.seq_lens_list, meta.block_tables, meta.num_decode_seqs, BLOCK_SIZE, torch.float32
        ),
    )
    bf16_storage = on_huge_pages(storage.to(torch.bfloat16))  # the bf16 mode's pool
    runs = {
        "torch": (torch_meta, KernelBackend.TORCH, storage),
        "native": (meta, KernelBackend.NATIVE, storage),
        "native_bf16": (meta, KernelBackend.NATIVE, bf16_storage),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for m, backend, pool in runs.values():  # warm-up
        step_ms(q, pool, m, backend)
    for _ in range(rounds):
        for name, (m, backend, pool) in runs.items():
            times[name].append(step_ms(q, pool, m, backend))
    torch_ms, native_ms = statistics.median(times["torch"]), statistics.median(times["native"])
    bf16_ms = statistics.median(times["native_bf16"])
    return {
        "rows": q.shape[0],
        "seqs": meta.num_seqs,
        "torch_ms": round(torch_ms, 2),
        "native_ms": round(native_ms, 2),
        "speedup": round(torch_ms / native_ms, 2),
        "native_bf16_ms": round(bf16_ms, 2),
        "bf16_speedup": round(native_ms / bf16_ms, 2),
    }


def measure_kv(context: int, rounds: int, seed: int) -> dict[str, float]:
    """A decode step of KV_ROWS rows of ``context`` tokens on fp32 pages and on bf16 pages, alternated: wall
    time, and the process's CPU time (steadier where other work shares the cores)."""
    rng = random.Random(seed)
    q, storage, meta = make_step([(1, context)] * KV_ROWS, rng)
    rounded = storage.to(torch.bfloat16)
    pools = {"fp32": on_huge_pages(rounded.float()), "bf16": on_huge_pages(rounded)}  # the same values
    del rounded
    del storage
    one_page = torch.full_like(meta.block_tables, int(meta.block_tables[0, 0]))  # [num_seqs, max_blocks]
    cached_meta = dataclasses.replace(meta, block_tables=one_page)
    times: dict[str, list[float]] = {name: [] for name in pools}
    cached_times: dict[str, list[float]] = {name: [] for name in pools}
    cpu_times: dict[str, list[float]] = {name: [] for name in pools}
    for pool in pools.values():  # warm-up
        step_ms(q, pool, meta, KernelBackend.NATIVE)
    for _ in range(rounds):
        for name, pool in pools.items():
            times[name].append(step_ms(q, pool, meta, KernelBackend.NATIVE))
            cpu_times[name].append(step_ms(q, pool, meta, KernelBackend.NATIVE, time.process_time))
            cached_times[name].append(step_ms(q, pool, cached_meta, KernelBackend.NATIVE))
    outputs = {}
    for name, pool in pools.items():
        kv = pool[:, 0].view(pool.shape[0], 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # layer 0
        outputs[name] = paged_attention(q, kv, meta, HEAD_DIM**-0.5, KernelBackend.NATIVE)
    fp32_ms, bf16_ms = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    kv_values = KV_ROWS * context * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM  # K and V a step reads
    return {
        "rows": KV_ROWS,
        "context": context,
        "fp32_kv_ms": round(fp32_ms, 2),
        "bf16_kv_ms": round(bf16_ms, 2),
        "speedup": round(fp32_ms / bf16_ms, 2),
        "fp32_kv_cached_ms": round(statistics.median(cached_times["fp32"]), 2),
        "bf16_kv_cached_ms": round(statistics.median(cached_times["bf16"]), 2),
        "fp32_kv_gb_s": round(kv_values * 4 / fp32_ms / 1e6, 1),
        "bf16_kv_gb_s": round(kv_values * 2 / bf16_ms / 1e6, 1),
        "fp32_kv_cpu_ms": round(statistics.median(cpu_times["fp32"]), 2),
        "bf16_kv_cpu_ms": round(statistics.median(cpu_times["bf16"]), 2),
        "cpu_speedup": round(statistics.median(cpu_times["fp32"]) / statistics.median(cpu_times["bf16"]), 2),
        "max_abs_diff": float((outputs["fp32"] - outputs["bf16"]).abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of each path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--kv", action="store_true", help="the native op on fp32 against bf16 K/V pages, decode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if native_ops() is None:
        sys.stderr.write(f"the native kernels are unavailable: {unavailable_reason()}\n")
        return 1
    results = {"threads": torch.get_num_threads(), "rounds": args.rounds}
    if args.kv:
        for context in KV_CONTEXTS:
            results[f"decode_{context}"] = entry = measure_kv(context, args.rounds, args.seed)
            sys.stdout.write(f"decode step (30 layers): {', '.join(f'{k} {v}' for k, v in entry.items())}\n")
        if args.json:
            sys.stdout.write(json.dumps(results) + "\n")
        return 0
    for kind in SEQS:
        results[kind] = measure(kind, args.rounds, args.seed)
        line = ", ".join(f"{k} {v}" for k, v in results[kind].items())
        sys.stdout.write(f"{kind} step (30 layers): {line}\n")
    if args.json:
        sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
