"""scripts/tools/timed_steps.py: a step stopped at its time limit is killed with its children, a failing or
missing command leaves the next ones running, and past the deadline nothing starts."""

import os
import time
from pathlib import Path

import pytest

from scripts.tools import timed_steps
from scripts.tools.timed_steps import Command, Step


def test_a_stopped_step_is_killed_with_its_children_and_the_next_steps_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timed_steps, "MIN_STEP_S", 0)
    child = tmp_path / "child.pid"
    hang = Command("hang", ("sh", "-c", f"sleep 60 & echo $! > {child}; wait"))
    env = dict(os.environ)
    started = time.monotonic()
    stopped = timed_steps.run_step(Step("hang", (hang,), "hang.log", budget_s=1), env, tmp_path, started + 60)
    assert stopped.returncode == timed_steps.TIMED_OUT and stopped.seconds < 10
    assert "stopped after 1 s" in (tmp_path / "hang.log").read_text()
    time.sleep(0.2)
    assert not is_running(int(child.read_text())), "the step's child outlived it"

    commands = (Command("fails", ("false",)), Command("passes", ("true",)), Command("absent", ("no-such-tool-x",)))
    later = timed_steps.run_step(Step("later", commands, "later.log", budget_s=30), env, tmp_path, started + 60)
    assert later.commands == {"fails": 1, "passes": 0, "absent": timed_steps.NOT_FOUND}
    assert later.returncode == 1

    late = timed_steps.run_step(Step("late", commands, "late.log", budget_s=30), env, tmp_path, time.monotonic())
    assert set(late.commands.values()) == {timed_steps.TIMED_OUT}, "past the deadline nothing starts"


def is_running(pid: int) -> bool:
    """Whether ``pid`` is alive: a killed process waiting for its parent to reap it (state Z) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
