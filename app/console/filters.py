"""Jinja filters of the console's templates: limits, times, sizes and counts in words and units."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar.plugins.jinja import JinjaTemplateEngine

KIB = 1024


def limit(value: int | float | None) -> str:
    return "unlimited" if value is None else f"{value:,}"


def when(value: datetime | None, empty: str = "never") -> str:
    return empty if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


def size(num_bytes: int) -> str:
    amount = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < KIB or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= KIB
    return f"{amount:.1f} GiB"


def count(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def millis(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


def percent(part: int, whole: int) -> str:
    return "–" if not whole else f"{100.0 * part / whole:.1f}%"


FILTERS: dict[str, Any] = {
    "limit": limit,
    "when": when,
    "size": size,
    "count": count,
    "millis": millis,
    "percent": percent,
}


def add_filters(engine: JinjaTemplateEngine) -> None:
    engine.engine.filters.update(FILTERS)
