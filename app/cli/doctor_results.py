"""What each ``loraplex doctor`` check found, and how the results print (text for people, JSON for machines)."""

import enum
import json
from dataclasses import dataclass, field


class Status(enum.Enum):
    PASS = "ok"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    values: dict[str, float | int | str] = field(default_factory=dict)  # the numbers, for --json


def exit_status(results: list[CheckResult]) -> int:
    """0 when every check that ran passed, else 1."""
    return int(any(result.status is Status.FAIL for result in results))


def render_text(results: list[CheckResult]) -> str:
    width = max(len(result.name) for result in results)
    lines = [f"{result.status.value:<4}  {result.name:<{width}}  {result.detail}" for result in results]
    counts = {status: sum(result.status is status for result in results) for status in Status}
    lines.append(f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped")
    return "\n".join(lines)


def render_json(results: list[CheckResult]) -> str:
    checks = [
        {"name": result.name, "status": result.status.name.lower(), "detail": result.detail, **result.values}
        for result in results
    ]
    return json.dumps({"passed": exit_status(results) == 0, "checks": checks}, indent=2)
