"""The `loraplex` command: the base model, the database, and the server."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import click

from app.cli.adapters import adapters, usage
from app.cli.admin import create_admin_key_locally, keys, tenants
from app.model_store import ModelStoreError, pull_default_model, resolve_model
from app.observability.log_format import configure_logging
from app.settings import Settings, SettingsError, log_level_from_env

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Context:
    """What every command gets: the settings, read once."""

    def __init__(self) -> None:
        try:
            self.settings = Settings.from_env()
        except SettingsError as error:
            raise click.ClickException(str(error)) from None


pass_context = click.make_pass_decorator(_Context, ensure=True)


@click.group(
    help="A multi-tenant multi-LoRA gateway: one base model, many tenants' adapters.",
    epilog="Environment: LORAPLEX_HOME (data folder), LORAPLEX_MODEL ('default' or a model folder), "
    "DATABASE_URL (PostgreSQL; unset: an embedded one in the data folder), LORAPLEX_LOG_LEVEL (info; debug "
    "adds every library's lines). The management commands "
    "(tenants, keys, adapters, usage) call a running server: LORAPLEX_URL, LORAPLEX_ADMIN_KEY.",
)
def cli() -> None:
    try:
        level = log_level_from_env()
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    configure_logging(json_lines=os.environ.get("LORAPLEX_LOG_FORMAT", "").lower() == "json", level=level)


for _group in (tenants, keys, adapters, usage):
    cli.add_command(_group)


@cli.group(help="Manage the base model.")
def models() -> None:
    pass


@models.command("pull", help="Download and convert the default model into the data folder; print its folder.")
@click.option("--force", is_flag=True, help="Convert again even if the folder is complete.")
@pass_context
def models_pull(context: _Context, force: bool) -> None:
    click.echo(_model_call(lambda: pull_default_model(context.settings.home, force=force)))


@models.command("path", help="Print the folder of the configured model (pulling the default one if needed).")
@pass_context
def models_path(context: _Context) -> None:
    click.echo(_model_call(lambda: resolve_model(context.settings.model, context.settings.home)))


@cli.group(help="Manage the database.")
def db() -> None:
    pass


@db.command("upgrade", help="Apply the schema migrations to the database in use.")
@pass_context
def db_upgrade(context: _Context) -> None:
    from app.db.migrate import upgrade

    with _database_url(context.settings) as url:
        upgrade(url)
    click.echo("database schema is up to date")


@db.command("url", help="Print the URL of the database in use (the embedded one answers while the server runs).")
@pass_context
def db_url(context: _Context) -> None:
    with _database_url(context.settings) as url:
        click.echo(url)


@cli.group(help="Administer the database in use directly (no server needed).")
def admin() -> None:
    pass


@admin.command("create-key", help="Create a key with the `admin` scope and print it; it is shown only this once.")
@click.option("--name", default="admin", show_default=True, help="A label for the key.")
@pass_context
def admin_create_key(context: _Context, name: str) -> None:
    with _database_url(context.settings) as url:
        key = create_admin_key_locally(context.settings, url, name)
    click.echo(key)
    click.echo("This admin key is shown only now: store it, e.g. as LORAPLEX_ADMIN_KEY.", err=True)


@cli.command(help="Start the server (the OpenAI API on /v1, operations on /health, /ready, /metrics).")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    envvar="LORAPLEX_HOST",
    show_envvar=True,
    help="Address to listen on.",
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    envvar="LORAPLEX_PORT",
    show_envvar=True,
    help="Port to listen on.",
)
@pass_context
def serve(context: _Context, host: str, port: int) -> None:
    from app.serve import ListenError, open_listener, run_server

    try:
        listener = open_listener(host, port)  # before anything is created, so a taken port costs nothing
    except ListenError as error:
        raise click.ClickException(str(error)) from None
    _model_call(lambda: resolve_model(context.settings.model, context.settings.home))
    run_server(context.settings, listener)


@cli.group(help="The native CPU kernels (C++, built once per machine and CPU).")
def kernels() -> None:
    pass


@kernels.command(
    "build",
    help="Build the native CPU kernels for this CPU now (else the engine builds them at its first start); print "
    "their folder. LORAPLEX_NATIVE_MARCH builds for another x86 target (e.g. haswell), CXX names the compiler.",
)
def kernels_build() -> None:
    from loraplex_kernels.native_cpu import build_native

    build = build_native()
    if build.ops is None:
        raise click.ClickException(f"{build.reason}\nThe engine runs torch's kernels instead (slower).")
    click.echo(build.folder)


@cli.command(help="Check this machine: the device, the kernel backend, each op against torch, a short timed generate.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@pass_context
def doctor(context: _Context, as_json: bool) -> None:
    from app.cli.doctor import run_doctor
    from app.cli.doctor_results import exit_status, render_json, render_text

    results = run_doctor(context.settings)
    click.echo(render_json(results) if as_json else render_text(results))
    if exit_status(results):
        raise click.exceptions.Exit(1)


def _model_call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ModelStoreError as error:
        raise click.ClickException(str(error)) from None


@contextmanager
def _database_url(settings: Settings) -> Iterator[str]:
    """The database URL in use: DATABASE_URL, or the embedded server's (stopped on exit unless a server uses it)."""
    if settings.database_url:
        yield settings.database_url
        return
    from app.db.embedded import EmbeddedDatabaseError, EmbeddedPostgres

    embedded = EmbeddedPostgres(settings.home / "postgres")
    try:
        url = embedded.start()
    except EmbeddedDatabaseError as error:
        raise click.ClickException(str(error)) from None
    try:
        yield url
    finally:
        embedded.stop()


def main(argv: list[str] | None = None) -> int:
    """Run one `loraplex` command and return its exit status."""
    try:
        cli.main(args=argv, prog_name="loraplex", standalone_mode=False)
    except click.ClickException as error:
        error.show()
        return error.exit_code
    except click.exceptions.Abort:
        click.echo("loraplex: interrupted", err=True)
        return 130
    except click.exceptions.Exit as exit_:
        return exit_.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
