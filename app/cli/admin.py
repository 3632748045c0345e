"""The management commands ``loraplex tenants|keys ...`` against a running server's admin API
(``app/cli/adapters.py`` has ``adapters`` and ``usage``; ``app/cli/management.py`` what the groups share).

Lists print a table (``--json`` for machines), changes print one line each, and every failure exits
non-zero with one line saying what went wrong. ``create_admin_key_locally`` backs
``loraplex admin create-key``, which works on the database itself, for the first admin key.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

import click

from app.cli.limits import limit_change_options, limit_changes, limit_option, limits_text
from app.cli.management import (
    Connection,
    first_line,
    json_option,
    management_group,
    pass_connection,
    show,
    show_list,
)
from app.settings import Settings

SCOPES = ("inference", "admin", "tenant-admin")
DEFAULT_GRACE_PERIOD_S = 3600  # the server's default too: an hour to roll the new key out

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


# tenants

tenants = management_group("tenants", "Create, list, limit and disable tenants on a running server.")


@tenants.command("create", help="Create a tenant named NAME.")
@click.argument("name")
@limit_option("--rpm", "Requests a minute")
@limit_option("--tpm", "Tokens a minute")
@limit_option("--max-concurrent", "Requests running at once")
@limit_option("--monthly-token-budget", "Tokens a calendar month")
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
@limit_change_options("tenant")
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
    changes: dict[str, float | None] = dict(limit_changes(limits))
    if weight is not None:
        changes["fair_share_weight"] = weight
    if not changes:
        raise click.ClickException(
            "nothing to change: give --rpm, --tpm, --max-concurrent, --monthly-token-budget or --weight"
        )
    client = connection.client()
    record = client.update_tenant(client.resolve_tenant(tenant)["id"], **changes)
    show(record, as_json, f"tenant {record['name']} ({record['id']}): {limits_text(record)}")


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
    help="What the key may do, repeated for several (default: inference): admin in the `admin` tenant only, "
    "tenant-admin (its tenant's keys, adapters and usage) in any other.",
)
@click.option("--expires-at", help="When the key stops working, ISO 8601 with an offset, e.g. 2030-01-01T00:00:00Z.")
@limit_option("--rpm", "Requests a minute, for this key", "the tenant's alone")
@limit_option("--tpm", "Tokens a minute, for this key", "the tenant's alone")
@limit_option("--max-concurrent", "Requests running at once, for this key", "the tenant's alone")
@limit_option("--monthly-token-budget", "Tokens a calendar month, for this key", "the tenant's alone")
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
@limit_change_options("key")
@json_option
@pass_connection
def keys_limit(connection: Connection, key_id: str, as_json: bool, **limits: int | str | None) -> None:
    changes = limit_changes(limits)
    if not changes:
        raise click.ClickException("nothing to change: give --rpm, --tpm, --max-concurrent or --monthly-token-budget")
    key = connection.client().update_key(key_id, **changes)
    show(key, as_json, f"key {key['name']} ({key['prefix']}, {key['id']}): {limits_text(key)}")


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


# the first admin key, made in the database itself


def create_admin_key_locally(settings: Settings, database_url: str, name: str) -> str:
    """Migrate the database, then make a key with the `admin` scope in it; return the plaintext."""
    from sqlalchemy.exc import SQLAlchemyError

    from app.admin.keys.first_admin import create_admin_key
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
    finally:
        root_logger.setLevel(level)


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
