"""A CUDA graph's adapter tables (engine/step/graph_lora.py): each step loaded into the padded tables gives what
the step's own tables give, whatever the step before left in them.

On a CPU the Triton kernels run under the interpreter; on a CUDA machine with it off (scripts/tools/gpu_checks.py)
they run on the GPU, as a graph's launches do.
"""

import os

import pytest
import torch

from engine.adapters.lora_batch import LoraGroup, LoraStep
from engine.memory.host_to_device import move_to_device
from engine.step.graph_lora import GraphLoraTables, LoraCapacity
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.lora_metadata import ModuleRows, build_sgmv_metadata

IN_DIM, OUT_DIMS = 32, (32, 16, 16)
NUM_LAYERS, PAGE_ELEMS, ROW_STRIDE = 2, 4096, 64  # 64 rows of up to 64 elements in a page's layer
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu")
ROWS = 8  # the graph's bucket
X = [ModuleRows(8 * m, 8 * m + 4, 4) for m in range(3)]  # rank 4: table rows 0..23
Y = [ModuleRows(24 + 16 * m, 24 + 16 * m + 8, 8) for m in range(3)]  # rank 8: table rows 24..71
ROW_ADDR = [(i // 64) * NUM_LAYERS * PAGE_ELEMS + (i % 64) * ROW_STRIDE for i in range(72)]


def _step(segments: list) -> LoraStep:
    """A step's tables on the host, as the engine builds them."""
    meta = build_sgmv_metadata(segments, ROW_ADDR, IN_DIM, OUT_DIMS)
    return LoraStep({"qkv": LoraGroup(meta, None)}, PAGE_ELEMS, KernelBackend.TRITON)


def _apply(step: LoraStep, x: torch.Tensor, y: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    step.apply("qkv", x, out, 1, storage)
    return out


def test_each_step_in_the_padded_tables_gives_its_own_tables_result() -> None:
    """Three tiles, then one tile over the rows another one covered (a stale tile would add Y twice to rows 4..7),
    then six of the eight rows (the last two are padding: untouched)."""
    generator = torch.Generator().manual_seed(3)
    storage = torch.randn(2, NUM_LAYERS, PAGE_ELEMS, generator=generator).to(DEVICE)  # [pages, layers, P]
    x = torch.randn(ROWS, IN_DIM, generator=generator).to(DEVICE)  # [rows, in_dim]
    y = torch.randn(ROWS, sum(OUT_DIMS), generator=generator).to(DEVICE)  # [rows, y_width]
    steps = [
        _step([(4, X), (2, Y), (2, X)]),
        _step([(2, None), (6, Y), (0, None)]),
        _step([(1, None), (3, X), (2, Y)]),
    ]
    capacity = LoraCapacity.of(steps[0])
    assert capacity == LoraCapacity(("qkv",), 16, 4)
    assert all(LoraCapacity.of(step) == capacity for step in steps)
    tables = GraphLoraTables(capacity, steps[0], ROWS, DEVICE)
    # The graph's kernels are compiled for rows at multiples of 16 elements, as every step's are here.
    assert tables.step.groups["qkv"].meta.row_align == 16
    assert all(step.groups["qkv"].meta.row_align == 16 for step in steps)

    assert torch.equal(_apply(tables.step, x, y, storage), y), "cleared tables read no adapter row"
    for step in steps:
        tables.load(step)
        num_tokens = step.groups["qkv"].meta.num_tokens
        got = _apply(tables.step, x, y, storage)
        expected = _apply(move_to_device(step, DEVICE), x[:num_tokens], y[:num_tokens], storage)
        torch.testing.assert_close(got[:num_tokens], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[num_tokens:], y[num_tokens:])
        assert not torch.equal(expected, y[:num_tokens]), "the step's adapters change its rows"


@pytest.mark.parametrize(
    ("segments", "rank", "count"),
    [
        ([(1, X)], 16, 1),
        ([(1, Y), (1, None), (1, X)], 16, 4),
        ([(40, X), (1, Y)], 16, 4),  # 40 tokens are 3 tiles: 4 tiles in all
        ([(1, [ModuleRows(0, 20, 20), None, None])], 32, 1),
    ],
)
def test_capacity_rounds_rank_and_segments_up_to_powers_of_two(segments: list, rank: int, count: int) -> None:
    rows = ROW_ADDR + [ROW_ADDR[-1] + ROW_STRIDE * (i + 1) for i in range(8)]
    meta = build_sgmv_metadata(segments, rows, IN_DIM, OUT_DIMS)
    capacity = LoraCapacity.of(LoraStep({"qkv": LoraGroup(meta, None)}, PAGE_ELEMS, KernelBackend.TRITON))
    assert (capacity.rank, capacity.segments) == (rank, count)
