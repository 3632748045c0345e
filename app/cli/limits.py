"""The limit options of the tenant and key commands: ``--rpm``, ``--tpm``, ``--max-concurrent`` and
``--monthly-token-budget`` (a whole number from 0; in a ``limit`` command also ``none``, which clears
the limit), the admin API fields they set, and a record's limits as one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from app.cli.management import cell

CLEAR = "none"  # the value of a `limit` command's option that clears the limit
LIMIT_FLAGS = {  # option of the `limit` commands → field of the admin API
    "rpm": "rpm_limit",
    "tpm": "tpm_limit",
    "max_concurrent": "max_concurrent",
    "monthly_token_budget": "monthly_token_budget",
}


def limit_option(
    flag: str, help: str, default: str = "unlimited"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(flag, type=click.IntRange(min=0), help=f"{help} (default: {default}).")


class _LimitChange(click.ParamType):
    """A `limit` command's value: a whole number from 0, or `none` to clear the limit."""

    name = "N|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int) or value == CLEAR:
            return value
        if str(value).strip().lower() == CLEAR:
            return CLEAR
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor `{CLEAR}`", param, ctx)
        if number < 0:
            self.fail(f"{value} is below 0; give a whole number from 0, or `{CLEAR}`", param, ctx)
        return number


def limit_change_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--rpm, --tpm, --max-concurrent and --monthly-token-budget for a `limit` command; `none` clears one."""
    cleared = "unlimited" if what == "tenant" else "only the tenant's limit"

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        for flag, help in reversed(
            [
                ("--rpm", "Requests a minute"),
                ("--tpm", "Tokens a minute"),
                ("--max-concurrent", "Requests running at once"),
                ("--monthly-token-budget", "Tokens a calendar month"),
            ]
        ):
            command = click.option(flag, type=_LimitChange(), help=f"{help}; `{CLEAR}`: {cleared}.")(command)
        return command

    return add


def limit_changes(options: dict[str, int | str | None]) -> dict[str, int | None]:
    """The admin API fields the given options change (`none` → null); the options left out are not sent."""
    return {
        LIMIT_FLAGS[option]: None if value == CLEAR else int(value)
        for option, value in options.items()
        if value is not None
    }


def limits_text(record: dict[str, Any]) -> str:
    parts = [f"{flag.replace('_', '-')} {cell(field, record.get(field))}" for flag, field in LIMIT_FLAGS.items()]
    if "fair_share_weight" in record:
        parts.append(f"weight {record['fair_share_weight']:g}")
    return ", ".join(parts)
