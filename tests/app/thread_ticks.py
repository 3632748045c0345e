"""CPU time by thread from /proc: which threads of a process did a piece of work."""

from __future__ import annotations

from pathlib import Path


def cpu_ticks(stat: Path) -> int:
    """User + system CPU time in clock ticks from a /proc stat file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[int, int]:
    """Each live thread's CPU time in clock ticks, by thread id (threads that end while read are left out)."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ticks[int(task.name)] = cpu_ticks(task / "stat")
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return ticks
