"""A time and allocation budget for one render of a tenant's chat template, enforced inside the rendering thread.

Time. A template is code: a loop with no output, a macro that calls itself twice per call, or a filter
given the largest list the sandbox lets it build runs for as long as it likes, and bounds on what it
writes cannot see it. While a render runs, a trace function on its thread checks the clock on every call
of every Python frame, and on every line of the template's frames and of the library code its filters and
methods run (``json``'s encoder or ``textwrap`` say), and raises RenderDeadlineError once the deadline has
passed. Python unsets a trace function that raised, so the error must not be swallowed: it is a
BaseException, which no ``except Exception`` catches; and the sandbox's own hooks (each call, operator,
filter, loop iteration, slice and written part) check the clock too, so a render whose trace was lost
(its error raised in a finalizer, which swallows it) still stops at its next step. C functions are not
interrupted: the sandbox's size bounds (app/tool_calls/template_sandbox.py) keep each of them short.

Memory. Each value the sandbox sees built (by an operator, a call, a filter, a slice, ``~``, a macro's or
block's body, the output) is charged to the render by its size (template_sizes.size_of), and the render
is refused once it has built ``MAX_BUILT_SIZE`` in all, however little of it is still alive: a value may
be kept in each frame of a macro that calls itself, or in each item of a list, so bounding each value
alone does not bound their sum.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from types import FrameType
from typing import Any, TypeVar

import jinja2

from app.tool_calls.template_sizes import MAX_VALUE_SIZE, TemplateBoundError

# What one render may build in all: four prompts of the largest size (about 100 MiB at most, a list of short
# strings taking about 6 bytes a unit of size). A real template builds its prompt
# a few times over (each message concatenated, then written).
MAX_BUILT_SIZE = 4 * MAX_VALUE_SIZE

# Frames whose lines are not traced, only their calls: Jinja's and this package's own code is entered for every
# value a template touches (tracing each of its lines would make a render ~20 times slower), and its loops call
# a Python function per item or run over values the sizes bound.
_CALLS_ONLY = (os.path.dirname(jinja2.__file__), os.path.dirname(__file__))

T = TypeVar("T")


class RenderDeadlineError(BaseException):
    """The render ran past its deadline (a BaseException: no library's ``except Exception`` may swallow it)."""


class RenderBudget:
    """One render's deadline and what it has built so far."""

    __slots__ = ("deadline", "size_built")

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.size_built = 0

    def check_clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderDeadlineError

    def charge(self, size: int, what: str) -> None:
        self.size_built += size
        if self.size_built > MAX_BUILT_SIZE:
            raise TemplateBoundError(
                f"{what} went past the {MAX_BUILT_SIZE} characters one render may build in all (an item of a list "
                "or dict counts as 8)"
            )
        self.check_clock()


_current: ContextVar[RenderBudget | None] = ContextVar("render_budget", default=None)


def charge(size: int, what: str) -> None:
    """Charge ``size`` to the render running on this thread, if it has a budget (a tenant's template)."""
    budget = _current.get()
    if budget is not None:
        budget.charge(size, what)


def check_clock() -> None:
    """RenderDeadlineError if the render running on this thread has a deadline and has passed it."""
    budget = _current.get()
    if budget is not None:
        budget.check_clock()


def run_with_deadline(render: Callable[[], T], seconds: float) -> T:
    """``render()`` under a fresh budget: RenderDeadlineError once it has run ``seconds``, TemplateBoundError once
    it has built ``MAX_BUILT_SIZE``."""
    budget = RenderBudget(seconds)
    deadline = budget.deadline

    def trace_line(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderDeadlineError
        return trace_line

    def trace_call(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderDeadlineError
        return None if frame.f_code.co_filename.startswith(_CALLS_ONLY) else trace_line

    token = _current.set(budget)
    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    sys.settrace(trace_call)
    try:
        return render()
    finally:
        sys.settrace(previous)
        _current.reset(token)
