"""thread_switches: more busy processes than usable cores show up as time waited for a core (schedstat)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scripts.common import thread_switches as switches

BUSY_S = 1.0
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def _busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=BUSY_S + 2)]) for _ in range(count)]


@pytest.mark.skipif(
    not Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").exists(),
    reason="this kernel keeps no run-queue wait per thread (schedstat): the script reports 0 there",
)
def test_more_busy_processes_than_cores_wait_for_a_core() -> None:
    cores = len(os.sched_getaffinity(0))
    processes = _busy_processes(cores + 1)
    try:
        time.sleep(0.3)  # all of them spinning
        before = switches.snapshot()
        time.sleep(BUSY_S)
        after = switches.snapshot()
    finally:
        for process in processes:
            process.kill()
            process.wait()
    pids = {process.pid for process in processes}
    keys = [key for key in after if key[0] in pids and key in before]
    assert len(keys) == cores + 1
    waited_s = sum(after[key].runq_wait_s - before[key].runq_wait_s for key in keys)
    ran_s = sum(after[key].cpu_s - before[key].cpu_s for key in keys)
    # cores + 1 runnable for BUSY_S on `cores` cores: about BUSY_S of waiting in all (less under other load)
    assert waited_s > 0.3 * BUSY_S, (waited_s, ran_s)
    groups = switches.rates(before, after, BUSY_S)
    spinning = [group for group in groups if group.process == "python -c"]
    assert sum(group.runq_wait_percent for group in spinning) > 30.0, spinning
