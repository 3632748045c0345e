"""What every management command group (``loraplex tenants|keys|adapters|usage``) shares: the server it
talks to (``--url``, LORAPLEX_URL) with which admin key (``--admin-key``, LORAPLEX_ADMIN_KEY), AdminErrors
turned into one line and a non-zero exit, and the printing of records (one line, a table, or ``--json``).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import click

from app.cli.admin_client import DEFAULT_URL, AdminClient, AdminError

URL_ENV = "LORAPLEX_URL"
ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
NO_ADMIN_KEY = f"no admin key: pass --admin-key or set {ADMIN_KEY_ENV}"
NONE_SHOWN = "-"  # an unset limit or time in a table


class Connection:
    """The server a group's commands talk to; the client is made on first use, so --help needs no key."""

    def __init__(self, url: str, admin_key: str | None) -> None:
        self.url = url
        self.admin_key = admin_key
        self._client: AdminClient | None = None

    def client(self) -> AdminClient:
        if not self.admin_key:
            raise click.ClickException(NO_ADMIN_KEY)
        if self._client is None:
            self._client = AdminClient(self.url, self.admin_key)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


pass_connection = click.make_pass_decorator(Connection)


class _ManagementGroup(click.Group):
    """A group whose commands' AdminErrors end the program with their one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AdminError as error:
            raise click.ClickException(str(error)) from None


def management_group(name: str, help: str) -> click.Group:
    @click.group(name, cls=_ManagementGroup, help=help)
    @click.option("--url", envvar=URL_ENV, default=DEFAULT_URL, show_default=True, help=f"The server ({URL_ENV}).")
    @click.option(
        "--admin-key",
        envvar=ADMIN_KEY_ENV,
        help=f"A key with the `admin` scope, or `tenant-admin` for its own tenant's keys, adapters and usage "
        f"({ADMIN_KEY_ENV}).",
    )
    @click.pass_context
    def group(ctx: click.Context, url: str, admin_key: str | None) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # its INFO line per request is noise in a command's output
        ctx.obj = Connection(url, admin_key)
        ctx.call_on_close(ctx.obj.close)

    return group


json_option = click.option("--json", "as_json", is_flag=True, help="Print the server's JSON instead of text.")


def show(record: dict[str, Any], as_json: bool, line: str) -> None:
    click.echo(json.dumps(record, indent=2) if as_json else line)


def show_list(rows: list[dict[str, Any]], columns: list[tuple[str, str]], as_json: bool, empty: str) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo(empty)
    else:
        click.echo(_table(rows, columns))


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[header for header, _ in columns]]
    cells += [[cell(field, row.get(field)) for _, field in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in cells
    )


def cell(field: str, value: Any) -> str:
    if value is None:
        return NONE_SHOWN
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    if field.endswith("_at"):
        return _when(value)
    if field == "size_bytes":
        return human_size(value)
    return str(value)


def _when(value: str) -> str:
    """A server time as ``2026-03-01 12:00:05Z`` (UTC, to the second)."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}Z"


def human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
