"""The console's engine page lists each worker's pool by owner: the scratch page only where a worker has one."""

import dataclasses

from app.console.engine_routes import worker_view
from tests.app.test_router_metrics import _stats


def test_pool_rows_list_the_scratch_page_only_where_there_is_one() -> None:
    cpu = _stats(1, [], [])  # free 60, kv 25, prefix cache 10, adapter 5 of 100 pages
    gpu = dataclasses.replace(cpu, pages_by_owner={**cpu.pages_by_owner, "free": 59, "scratch": 1})

    assert [label for label, _, _ in worker_view("w", cpu).pool_rows] == [
        "KV of running requests",
        "Prefix cache",
        "Adapters",
        "Free",
    ]
    rows = worker_view("w", gpu).pool_rows
    assert rows[3] == ("Scratch (CUDA graphs)", 1, 1.0)
    assert rows[4] == ("Free", 59, 59.0)
    assert sum(pages for _, pages, _ in rows) == gpu.num_pages
