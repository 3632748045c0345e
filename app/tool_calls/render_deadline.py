"""A time budget for one render of a tenant's chat template, enforced inside the rendering thread.

A template is code: a loop with no output (``range`` is capped at 100000 items, but loops nest) or a
macro that calls itself twice per call runs for as long as it likes, and bounds on what it writes
cannot see it. While a render runs, a trace function on its thread checks the clock when any Python
function is entered (Jinja's runtime, filters, macros) and on every line of the compiled template's own
code (``co_filename == "<template>"``, one line per loop iteration), and raises once the deadline has
passed; every other frame runs untraced. It raises only in the template's frames and Jinja's or the
sandbox's own, never in code that merely runs meanwhile on the thread (a garbage collector callback, say).
C functions are not interrupted: the sandbox's size bounds (app/tool_calls/template_sandbox.py) keep each
of them short.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import jinja2

TEMPLATE_FILENAME = "<template>"  # the co_filename Jinja gives code compiled from a string
# Frames a render may be stopped in: the template's own, Jinja's, and this package's (the sandbox).
_STOPPABLE_PREFIXES = (TEMPLATE_FILENAME, os.path.dirname(jinja2.__file__), os.path.dirname(__file__))

T = TypeVar("T")


class RenderDeadlineError(Exception):
    """The render ran past its deadline."""


def run_with_deadline(render: Callable[[], T], seconds: float) -> T:
    """``render()``, raising RenderDeadlineError once it has run ``seconds`` (checked between lines)."""
    deadline = time.monotonic() + seconds

    def trace_line(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderDeadlineError
        return trace_line

    def trace_call(frame: FrameType, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        if time.monotonic() > deadline and filename.startswith(_STOPPABLE_PREFIXES):
            raise RenderDeadlineError
        return trace_line if filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    sys.settrace(trace_call)
    try:
        return render()
    finally:
        sys.settrace(previous)
