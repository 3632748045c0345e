"""Every thread's CPU time and context switches on this machine, from /proc, and their difference over time.

A snapshot reads, for each thread of each process, its user + system CPU (``/proc/<pid>/task/<tid>/stat``),
its voluntary and involuntary context switches (``.../status``) and the time it spent ready to run but
waiting for a core (``.../schedstat``; zero where the kernel keeps no such count). A voluntary switch is a
wake-up ended by the thread itself (it slept again); an involuntary one is the thread taken off its core for
another, and the wait counts how long such threads waited to get a core back. Threads are grouped by
process (named from its command line: a program's file name, a Python script's or module's name, or the
title a Ray worker gives itself) and thread name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ThreadCounters:
    process: str
    thread: str
    cpu_s: float
    voluntary: int
    involuntary: int
    runq_wait_s: float


@dataclass(frozen=True, slots=True)
class GroupRates:
    """One (process, thread name) group's rates over an interval."""

    process: str
    thread: str
    cpu_percent: float  # of one core
    voluntary_per_s: float
    involuntary_per_s: float
    runq_wait_percent: float  # ready to run but waiting for a core, of one core's time


Snapshot = dict[tuple[int, int], ThreadCounters]


def snapshot() -> Snapshot:
    """Every readable thread's counters now, by (pid, tid); threads that end while read are skipped."""
    threads: Snapshot = {}
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            words = pid_dir.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
            kernel_name = f"[{pid_dir.joinpath('comm').read_text().strip()}]"
            process = process_name([word for word in words if word]) or kernel_name
            for task in pid_dir.joinpath("task").iterdir():
                threads[int(pid_dir.name), int(task.name)] = _thread(process, task)
        except (OSError, ValueError, IndexError):
            continue
    return threads


def process_name(words: list[str]) -> str:
    """A short name from a command line: ``gcs_server``, ``python -m app.cli.main``, ``python log_monitor.py``,
    ``python -c`` (a multiprocessing child), ``ray::ServeController``; empty for a kernel thread."""
    if not words:
        return ""
    if words[0].startswith("ray::"):  # a Ray worker's title, with the method it runs after a dot
        return words[0].split()[0].split(".")[0]
    program = Path(words[0]).name
    if not program.startswith("python"):
        return program
    for index, word in enumerate(words[1:], start=1):
        if word == "-m" and index + 1 < len(words):
            return f"python -m {words[index + 1]}"
        if word == "-c":
            return "python -c"
        if not word.startswith("-"):
            return f"python {Path(word).name}"
    return "python"


def stat_cpu_s(stat: str) -> float:
    """User plus system CPU seconds from the text of a process's or thread's /proc ``stat`` file."""
    fields = stat.rsplit(")", 1)[1].split()  # fields 3 on of proc(5): the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime (fields 14, 15) in clock ticks


def _thread(process: str, task: Path) -> ThreadCounters:
    stat = task.joinpath("stat").read_text()
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    switches = {}
    for line in task.joinpath("status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.endswith("ctxt_switches"):
            switches[key] = int(value)
    return ThreadCounters(
        process,
        name,
        stat_cpu_s(stat),
        switches["voluntary_ctxt_switches"],
        switches["nonvoluntary_ctxt_switches"],
        _runq_wait_s(task),
    )


def _runq_wait_s(task: Path) -> float:
    """Seconds the thread has waited on a run queue (the second field of ``schedstat``, in ns); 0 without it."""
    try:
        return int(task.joinpath("schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def rates(before: Snapshot, after: Snapshot, seconds: float) -> list[GroupRates]:
    """Each (process, thread name) group's CPU and switches a second between two snapshots, busiest first;
    only threads alive at both count."""
    totals: dict[tuple[str, str], list[float]] = {}
    for key, end in after.items():
        start = before.get(key)
        if start is None:
            continue
        total = totals.setdefault((end.process, end.thread), [0.0, 0.0, 0.0, 0.0])
        total[0] += end.cpu_s - start.cpu_s
        total[1] += end.voluntary - start.voluntary
        total[2] += end.involuntary - start.involuntary
        total[3] += end.runq_wait_s - start.runq_wait_s
    groups = [
        GroupRates(
            process,
            thread,
            round(100 * cpu / seconds, 2),
            round(vol / seconds, 1),
            round(invol / seconds, 1),
            round(100 * wait / seconds, 2),
        )
        for (process, thread), (cpu, vol, invol, wait) in totals.items()
    ]
    return sorted(groups, key=lambda g: (g.cpu_percent, g.voluntary_per_s), reverse=True)
