"""Commands run one after another under a time limit each, in a process group of their own, so that a command
that hangs or forks is stopped whole and the next one still runs; used by scripts/tools/gpu_checks.py.
"""

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

MIN_STEP_S = 10  # a step that would get less is not started
KILL_GRACE_S = 5  # between SIGTERM and SIGKILL to a stopped step's process group
TIMED_OUT = 124  # the exit status `timeout` gives a command it stopped
NOT_FOUND = 127  # the shell's for a command that does not exist


@dataclass(frozen=True, slots=True)
class Command:
    label: str
    argv: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Step:
    """One check: its commands run one after another within ``budget_s``, their output appended to ``log``."""

    name: str
    commands: tuple[Command, ...]
    log: str  # a file name in the output folder
    budget_s: int
    stdout: Path | None = None  # where the commands' stdout goes instead of the log (the bench's JSON line)


@dataclass(slots=True)
class StepResult:
    name: str
    returncode: int = 0
    seconds: float = 0.0
    commands: dict[str, int] = field(default_factory=dict)  # label: exit status
    note: str = ""


def run_command(argv: tuple[str, ...], env: dict[str, str], log, stdout, timeout_s: float, cwd: Path | None) -> int:
    """``argv`` in ``cwd``, in a process group of its own; the whole group is stopped at ``timeout_s`` (exit status
    124)."""
    try:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=log, start_new_session=True)
    except FileNotFoundError as error:
        log.write(f"{error}\n")
        return NOT_FOUND
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.write(f"\nstopped after {timeout_s:.0f} s\n")
        for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        return TIMED_OUT


def run_step(step: Step, env: dict[str, str], out: Path, deadline: float, cwd: Path | None = None) -> StepResult:
    """Every command of ``step`` within its budget and the deadline, in ``cwd`` (default: this process's); the first
    failing status is the step's."""
    result = StepResult(step.name)
    started = time.monotonic()
    step_end = min(started + step.budget_s, deadline)
    with (out / step.log).open("a") as log:
        if step.stdout is not None:
            step.stdout.parent.mkdir(parents=True, exist_ok=True)
            step.stdout.write_text("")
        for command in step.commands:
            left = step_end - time.monotonic()
            if left < MIN_STEP_S:
                log.write(f"$ {shlex.join(command.argv)}\nnot started: {left:.0f} s left of the step's time\n")
                result.commands[command.label] = TIMED_OUT
                continue
            log.write(f"$ {shlex.join(command.argv)}\n")
            log.flush()
            if step.stdout is not None:
                with step.stdout.open("a") as stdout:
                    status = run_command(command.argv, env, log, stdout, left, cwd)
            else:
                status = run_command(command.argv, env, log, log, left, cwd)
            log.write(f"exit status {status}\n")
            log.flush()
            result.commands[command.label] = status
    result.seconds = round(time.monotonic() - started, 1)
    result.returncode = next((status for status in result.commands.values() if status != 0), 0)
    return result
