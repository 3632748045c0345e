"""The page pool's memory on the CPU: advised for transparent huge pages before its first touch, and zeroed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.memory.host_memory import (
    HUGE_PAGE_BYTES,
    THP_MODES_THAT_ADVISE,
    transparent_huge_pages_mode,
    zeros_on_huge_pages,
)
from engine.memory.page_pool import PagePool


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            low, high = (int(bound, 16) for bound in first.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    sys.platform != "linux" or transparent_huge_pages_mode() not in THP_MODES_THAT_ADVISE,
    reason="needs Linux with transparent huge pages in mode always or madvise",
)
def test_a_cpu_pool_is_advised_for_huge_pages_and_zeroed() -> None:
    pool = PagePool(
        512, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=torch.device("cpu")
    )  # 32 MiB: whole huge pages inside
    assert pool.huge_pages
    middle = pool.storage.data_ptr() + pool.storage.numel() * pool.storage.element_size() // 2
    assert "hg" in vm_flags(middle)  # MADV_HUGEPAGE, whatever the system-wide setting
    assert not pool.storage.any()


def test_a_buffer_smaller_than_a_huge_page_is_not_advised() -> None:
    values, advised = zeros_on_huge_pages((HUGE_PAGE_BYTES // 8,), torch.float32)  # 1 MiB
    assert not advised
    assert not values.any()


FREEZE_CHILD = """
import gc, json
from engine.memory.host_memory import freeze_startup_heap
startup = [[i] for i in range(50_000)]  # objects of the start, alive as long as the process
frozen = freeze_startup_heap()
walked = len(gc.get_objects())  # what a full collection walks now


class Node:
    pass


node = Node()
node.self = node  # a cycle made while serving
del node
print(json.dumps({"frozen": frozen, "walked": walked, "collected": gc.collect()}))
"""


def test_freezing_the_startup_heap_leaves_full_collections_only_what_came_after() -> None:
    """In a process of its own, as a worker process or a Ray replica calls it: the start's objects are frozen, a full
    collection walks none of them, and a cycle made afterwards is still collected."""
    result = subprocess.run(
        [sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["frozen"] >= 50_000
    assert counts["walked"] < 1_000
    assert counts["collected"] >= 1
