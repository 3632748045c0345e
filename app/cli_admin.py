"""The management commands ``loraplex tenants|keys ...`` against a running server's admin API, and what every
management group shares (``app/cli_adapters.py`` has ``adapters`` and ``usage``).

Each group takes ``--url`` (LORAPLEX_URL) and ``--admin-key`` (LORAPLEX_ADMIN_KEY). Lists print a table
(``--json`` for machines), changes print one line each, and every failure exits non-zero with one line
saying what went wrong. ``create_admin_key_locally`` backs ``loraplex admin create-key``, which works on
the database itself, for the first admin key.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from app.admin_client import DEFAULT_URL, AdminClient, AdminError
from app.settings import Settings

URL_ENV = "LORAPLEX_URL"
ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
NO_ADMIN_KEY = f"no admin key: pass --admin-key or set {ADMIN_KEY_ENV}"
SCOPES = ("inference", "admin")
DEFAULT_GRACE_PERIOD_S = 3600  # the server's default too: an hour to roll the new key out
NONE_SHOWN = "-"  # an unset limit or time in a table
CLEAR = "none"  # the value of a `limit` command's option that clears the limit
LIMIT_FLAGS = {  # option of the `limit` commands → field of the admin API
    "rpm": "rpm_limit",
    "tpm": "tpm_limit",
    "max_concurrent": "max_concurrent",
    "monthly_token_budget": "monthly_token_budget",
}

TENANT_COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("STATUS", "status"),
    ("RPM", "rpm_limit"),
    ("TPM", "tpm_limit"),
    ("CONCURRENT", "max_concurrent"),
    ("MONTHLY TOKENS", "monthly_token_budget"),
    ("WEIGHT", "fair_share_weight"),
    ("CREATED", "created_at"),
]
KEY_COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("PREFIX", "prefix"),
    ("SCOPES", "scopes"),
    ("RPM", "rpm_limit"),
    ("TPM", "tpm_limit"),
    ("CONCURRENT", "max_concurrent"),
    ("MONTHLY TOKENS", "monthly_token_budget"),
    ("CREATED", "created_at"),
    ("EXPIRES", "expires_at"),
    ("REVOKED", "revoked_at"),
    ("LAST USED", "last_used_at"),
]


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
    @click.option("--admin-key", envvar=ADMIN_KEY_ENV, help=f"A key with the `admin` scope ({ADMIN_KEY_ENV}).")
    @click.pass_context
    def group(ctx: click.Context, url: str, admin_key: str | None) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # its INFO line per request is noise in a command's output
        ctx.obj = Connection(url, admin_key)
        ctx.call_on_close(ctx.obj.close)

    return group


json_option = click.option("--json", "as_json", is_flag=True, help="Print the server's JSON instead of text.")


def _limit_option(
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


def _limit_change_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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


def _limit_changes(options: dict[str, int | str | None]) -> dict[str, int | None]:
    """The admin API fields the given options change (`none` → null); the options left out are not sent."""
    return {
        LIMIT_FLAGS[option]: None if value == CLEAR else int(value)
        for option, value in options.items()
        if value is not None
    }


def _limits_text(record: dict[str, Any]) -> str:
    parts = [f"{flag.replace('_', '-')} {_cell(field, record.get(field))}" for flag, field in LIMIT_FLAGS.items()]
    if "fair_share_weight" in record:
        parts.append(f"weight {record['fair_share_weight']:g}")
    return ", ".join(parts)


# tenants

tenants = management_group("tenants", "Create, list, limit and disable tenants on a running server.")


@tenants.command("create", help="Create a tenant named NAME.")
@click.argument("name")
@_limit_option("--rpm", "Requests a minute")
@_limit_option("--tpm", "Tokens a minute")
@_limit_option("--max-concurrent", "Requests running at once")
@_limit_option("--monthly-token-budget", "Tokens a calendar month")
@click.option(
    "--weight",
    type=click.FloatRange(min=0, min_open=True),
    help="Its share of the engine when tenants compete, relative to the others' (default: 1).",
)
@json_option
@pass_connection
def tenants_create(
    connection: Connection,
    name: str,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    monthly_token_budget: int | None,
    weight: float | None,
    as_json: bool,
) -> None:
    tenant = connection.client().create_tenant(
        name,
        rpm_limit=rpm,
        tpm_limit=tpm,
        max_concurrent=max_concurrent,
        monthly_token_budget=monthly_token_budget,
        fair_share_weight=weight,
    )
    show(tenant, as_json, f"created tenant {tenant['name']} ({tenant['id']})")


@tenants.command(
    "limit", help="Change the limits or the weight of TENANT (an id or a name); they hold within a second."
)
@click.argument("tenant")
@_limit_change_options("tenant")
@click.option(
    "--weight",
    type=click.FloatRange(min=0, min_open=True),
    help="Its share of the engine when tenants compete, relative to the others'.",
)
@json_option
@pass_connection
def tenants_limit(
    connection: Connection, tenant: str, weight: float | None, as_json: bool, **limits: int | str | None
) -> None:
    changes: dict[str, float | None] = dict(_limit_changes(limits))
    if weight is not None:
        changes["fair_share_weight"] = weight
    if not changes:
        raise click.ClickException(
            "nothing to change: give --rpm, --tpm, --max-concurrent, --monthly-token-budget or --weight"
        )
    client = connection.client()
    record = client.update_tenant(client.resolve_tenant(tenant)["id"], **changes)
    show(record, as_json, f"tenant {record['name']} ({record['id']}): {_limits_text(record)}")


@tenants.command("list", help="List the tenants.")
@json_option
@pass_connection
def tenants_list(connection: Connection, as_json: bool) -> None:
    show_list(connection.client().list_tenants(), TENANT_COLUMNS, as_json, "no tenants")


@tenants.command("disable", help="Disable TENANT (an id or a name): its keys are refused within a second.")
@click.argument("tenant")
@pass_connection
def tenants_disable(connection: Connection, tenant: str) -> None:
    client = connection.client()
    record = client.update_tenant(client.resolve_tenant(tenant)["id"], status="disabled")
    click.echo(f"disabled tenant {record['name']} ({record['id']})")


# keys

keys = management_group("keys", "Create, list, limit, revoke and rotate API keys on a running server.")


@keys.command("create", help="Create an API key for TENANT (an id or a name) and print it, the only time it is shown.")
@click.argument("tenant")
@click.option("--name", default="default", show_default=True, help="A label for people, e.g. 'ci' or 'backend'.")
@click.option(
    "--scope",
    "scopes",
    type=click.Choice(SCOPES),
    multiple=True,
    help="What the key may do; repeat for both (default: inference).",
)
@click.option("--expires-at", help="When the key stops working, ISO 8601 with an offset, e.g. 2030-01-01T00:00:00Z.")
@_limit_option("--rpm", "Requests a minute, for this key", "the tenant's alone")
@_limit_option("--tpm", "Tokens a minute, for this key", "the tenant's alone")
@_limit_option("--max-concurrent", "Requests running at once, for this key", "the tenant's alone")
@_limit_option("--monthly-token-budget", "Tokens a calendar month, for this key", "the tenant's alone")
@json_option
@pass_connection
def keys_create(
    connection: Connection,
    tenant: str,
    name: str,
    scopes: tuple[str, ...],
    expires_at: str | None,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    monthly_token_budget: int | None,
    as_json: bool,
) -> None:
    client = connection.client()
    owner = client.resolve_tenant(tenant)
    key = client.create_key(
        owner["id"],
        name,
        list(scopes or ("inference",)),
        _checked_time(expires_at),
        rpm_limit=rpm,
        tpm_limit=tpm,
        max_concurrent=max_concurrent,
        monthly_token_budget=monthly_token_budget,
    )
    scope_text = ",".join(key["scopes"])
    line = f"created key {key['name']} ({key['id']}) for tenant {owner['name']} (scopes {scope_text}): {key['key']}"
    show(key, as_json, line)
    _warn_shown_once()


@keys.command("list", help="List the API keys of TENANT (an id or a name); prefixes only, never secrets.")
@click.argument("tenant")
@json_option
@pass_connection
def keys_list(connection: Connection, tenant: str, as_json: bool) -> None:
    client = connection.client()
    show_list(client.list_keys(client.resolve_tenant(tenant)["id"]), KEY_COLUMNS, as_json, "no keys")


@keys.command(
    "limit",
    help="Change the limits of the key KEY_ID; they narrow its tenant's and hold within a second.",
)
@click.argument("key_id")
@_limit_change_options("key")
@json_option
@pass_connection
def keys_limit(connection: Connection, key_id: str, as_json: bool, **limits: int | str | None) -> None:
    changes = _limit_changes(limits)
    if not changes:
        raise click.ClickException("nothing to change: give --rpm, --tpm, --max-concurrent or --monthly-token-budget")
    key = connection.client().update_key(key_id, **changes)
    show(key, as_json, f"key {key['name']} ({key['prefix']}, {key['id']}): {_limits_text(key)}")


@keys.command("revoke", help="Revoke the key KEY_ID: it is refused within a second.")
@click.argument("key_id")
@pass_connection
def keys_revoke(connection: Connection, key_id: str) -> None:
    key = connection.client().revoke_key(key_id)
    click.echo(f"revoked key {key.get('name', '')} ({key.get('prefix', '')}, {key_id})")


@keys.command("rotate", help="Replace the key KEY_ID with a new one (printed once); the old one works a while more.")
@click.argument("key_id")
@click.option(
    "--grace-period",
    type=click.IntRange(min=0),
    default=DEFAULT_GRACE_PERIOD_S,
    show_default=True,
    help="Seconds the old key keeps working.",
)
@json_option
@pass_connection
def keys_rotate(connection: Connection, key_id: str, grace_period: int, as_json: bool) -> None:
    key = connection.client().rotate_key(key_id, grace_period)
    line = f"rotated key {key_id} to {key['name']} ({key['id']}), old key valid {grace_period} s more: {key['key']}"
    show(key, as_json, line)
    _warn_shown_once()


# adapters


def create_admin_key_locally(settings: Settings, database_url: str, name: str) -> str:
    """Migrate the database, then make a key with the `admin` scope in it; return the plaintext."""
    from sqlalchemy.exc import SQLAlchemyError

    from app.admin.first_admin import create_admin_key
    from app.db.database import Database
    from app.db.migrate import upgrade
    from app.keys.secrets import load_or_create_key_secret

    async def create(secret: bytes) -> str:
        database = Database(database_url)
        try:
            return await create_admin_key(database, secret, name)
        finally:
            await database.close()

    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.setLevel(logging.WARNING)  # the key is this command's output; migration and audit lines are noise
    try:
        upgrade(database_url)
        return asyncio.run(create(load_or_create_key_secret(settings.home, settings.key_secret)))
    except (SQLAlchemyError, OSError) as error:
        raise click.ClickException(f"cannot create the key in the database: {first_line(error)}") from None
    except RuntimeError as error:  # e.g. the `admin` tenant was deleted
        raise click.ClickException(first_line(error)) from None
    finally:
        root_logger.setLevel(level)


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
    cells += [[_cell(field, row.get(field)) for _, field in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in cells
    )


def _cell(field: str, value: Any) -> str:
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


def _checked_time(value: str | None) -> str | None:
    """An --expires-at value, checked to be an ISO 8601 time with an offset, as the server wants it."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.ClickException(
            f"--expires-at {value!r} is not an ISO 8601 time, e.g. 2030-01-01T00:00:00Z"
        ) from None
    if moment.tzinfo is None:
        raise click.ClickException(f"--expires-at {value!r} has no offset; add one, e.g. Z for UTC")
    return moment.isoformat()


def _warn_shown_once() -> None:
    click.echo("The key is shown only now: store it somewhere safe.", err=True)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
