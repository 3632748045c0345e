"""The management commands ``loraplex adapters|usage ...`` against a running server's admin API."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from app.cli.management import (
    Connection,
    human_size,
    json_option,
    management_group,
    pass_connection,
    show,
    show_list,
)
from app.tool_calls.formats import FORMATS

ADAPTER_COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("RANK", "rank"),
    ("ALPHA", "alpha"),
    ("MODULES", "target_modules"),
    ("SIZE", "size_bytes"),
    ("STATUS", "status"),
    ("LOADED", "loaded"),
    ("PINNED", "pinned"),
    ("CREATED", "created_at"),
]


adapters = management_group("adapters", "Upload, list, load, pin and delete adapters on a running server.")


@adapters.command("upload", help="Upload the PEFT LoRA in FOLDER as TENANT's adapter NAME (its `model` name).")
@click.argument("tenant")
@click.argument("name")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--replace", is_flag=True, help="Replace the tenant's adapter of that name.")
@click.option(
    "--tool-call-format",
    type=click.Choice(sorted(FORMATS)),
    help="The format the adapter writes tool calls in (default: the server's).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The adapter's own chat template: a .jinja file or a tokenizer_config.json (default: FOLDER's "
    "chat_template.jinja, else its tokenizer_config.json's chat_template, else the base model's).",
)
@json_option
@pass_connection
def adapters_upload(
    connection: Connection,
    tenant: str,
    name: str,
    folder: Path,
    replace: bool,
    tool_call_format: str | None,
    chat_template: Path | None,
    as_json: bool,
) -> None:
    client = connection.client()
    owner = client.resolve_tenant(tenant)
    bar = _UploadBar(f"uploading {name}")
    try:
        adapter = client.upload_adapter(
            owner["id"],
            name,
            folder,
            replace=replace,
            tool_call_format=tool_call_format,
            chat_template=chat_template,
            on_start=bar.start,
            on_bytes=bar.update,
        )
    finally:
        bar.close()
    state = "loaded" if adapter.get("loaded") else "not loaded"
    chat = "".join(
        (
            ", its own chat template" if adapter.get("chat_template_sha256") else "",
            f", {adapter['tool_call_format']} tool calls" if adapter.get("tool_call_format") else "",
        )
    )
    line = (
        f"uploaded adapter {adapter['name']} ({adapter['id']}) for tenant {owner['name']}: rank {adapter['rank']}, "
        f"{human_size(adapter['size_bytes'])}, {state}{chat}"
    )
    show(adapter, as_json, line)


@adapters.command("list", help="List the adapters of TENANT (an id or a name).")
@click.argument("tenant")
@json_option
@pass_connection
def adapters_list(connection: Connection, tenant: str, as_json: bool) -> None:
    client = connection.client()
    show_list(client.list_adapters(client.resolve_tenant(tenant)["id"]), ADAPTER_COLUMNS, as_json, "no adapters")


@adapters.command("load", help="Load the adapter ADAPTER_ID into the engine now (else its first request does).")
@click.argument("adapter_id")
@pass_connection
def adapters_load(connection: Connection, adapter_id: str) -> None:
    _changed("loaded", adapter_id, connection.client().adapter_action(adapter_id, "load"))


@adapters.command("unload", help="Unload the adapter ADAPTER_ID from the engine (its next request loads it again).")
@click.argument("adapter_id")
@pass_connection
def adapters_unload(connection: Connection, adapter_id: str) -> None:
    _changed("unloaded", adapter_id, connection.client().adapter_action(adapter_id, "unload"))


@adapters.command("delete", help="Delete the adapter ADAPTER_ID; its usage rows stay.")
@click.argument("adapter_id")
@pass_connection
def adapters_delete(connection: Connection, adapter_id: str) -> None:
    _changed("deleted", adapter_id, connection.client().delete_adapter(adapter_id))


@adapters.command("pin", help="Keep the adapter ADAPTER_ID resident in the engine's pool (--unpin: let it go).")
@click.argument("adapter_id")
@click.option("--unpin", is_flag=True, help="Unpin instead.")
@pass_connection
def adapters_pin(connection: Connection, adapter_id: str, unpin: bool) -> None:
    adapter = connection.client().pin_adapter(adapter_id, pinned=not unpin)
    _changed("unpinned" if unpin else "pinned", adapter_id, adapter)


# usage

usage = management_group("usage", "Export usage per day, tenant and adapter from a running server.")


@usage.command("export", help="Print (or write to --output) usage per UTC day, tenant and adapter.")
@click.option("--start", help="First day, YYYY-MM-DD (default: 29 days before --end).")
@click.option("--end", help="Last day, YYYY-MM-DD, included (default: today, UTC).")
@click.option("--tenant", help="Only this tenant (an id or a name); a tenant-admin key gets only its own.")
@click.option("--adapter", help="Only this adapter (its id).")
@click.option("--format", "output_format", type=click.Choice(["csv", "json"]), default="csv", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False, writable=True, path_type=Path), help="Write to this file.")
@pass_connection
def usage_export(
    connection: Connection,
    start: str | None,
    end: str | None,
    tenant: str | None,
    adapter: str | None,
    output_format: str,
    output: Path | None,
) -> None:
    client = connection.client()
    tenant_id = None if tenant is None else client.resolve_tenant(tenant)["id"]
    body = client.usage(start=start, end=end, tenant_id=tenant_id, adapter_id=adapter, format=output_format)
    if output is None:
        click.echo(body, nl=not body.endswith(b"\n"))
        return
    output.write_bytes(body)
    if output_format == "csv":
        num_rows = sum(1 for _ in csv.reader(io.StringIO(body.decode()))) - 1  # less the header line
    else:
        num_rows = len(json.loads(body)["data"])
    click.echo(f"wrote {num_rows} usage rows to {output}")


def _changed(verb: str, adapter_id: str, adapter: dict[str, Any]) -> None:
    name = adapter.get("name")
    click.echo(f"{verb} adapter {name} ({adapter_id})" if name else f"{verb} adapter {adapter_id}")


class _UploadBar:
    """A progress bar in bytes on stderr, shown once the upload's length is known."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._bar: tqdm | None = None

    def start(self, num_bytes: int) -> None:
        self._bar = tqdm(
            desc=self.label, total=num_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )

    def update(self, num_bytes: int) -> None:
        if self._bar is not None:
            self._bar.update(num_bytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
