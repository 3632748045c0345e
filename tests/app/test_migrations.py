"""The migrations build the schema of docs/billing.md that billing jobs read."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

from app.db.migrate import alembic_config, upgrade
from engine.adapters.lora_adapter import adapter_digest
from tests.app.postgres import truncate_all

MIGRATION_TIMEOUT_S = 120


def _columns(url: str) -> dict[str, set[str]]:
    async def run() -> dict[str, set[str]]:
        connection = await asyncpg.connect(url)
        try:
            rows = await connection.fetch(
                "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
            )
        finally:
            await connection.close()
        columns: dict[str, set[str]] = {}
        for row in rows:
            columns.setdefault(row["table_name"], set()).add(row["column_name"])
        return columns

    return asyncio.run(run())


def test_upgrade_builds_the_documented_tables_and_is_idempotent(database_url: str) -> None:
    upgrade(database_url)  # a second upgrade at head changes nothing and does not fail
    columns = _columns(database_url)
    assert {
        "id",
        "request_id",
        "tenant_id",
        "api_key_id",
        "adapter_id",
        "model",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "status",
        "finish_reason",
        "started_at",
        "finished_at",
        "ttft_ms",
    } <= columns["usage_events"]
    assert {"day", "tenant_id", "adapter_id", "requests", "prompt_tokens", "completion_tokens"} <= columns[
        "usage_daily"
    ]
    assert {
        "id",
        "tenant_id",
        "prefix",
        "secret_hash",
        "scopes",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "rpm_limit",
        "tpm_limit",
        "max_concurrent",
        "monthly_token_budget",
    } <= columns["api_keys"]
    assert {
        "id",
        "name",
        "status",
        "rpm_limit",
        "tpm_limit",
        "max_concurrent",
        "monthly_token_budget",
        "fair_share_weight",
    } <= columns["tenants"]
    assert {"id", "tenant_id", "name", "base_model", "rank", "alpha", "target_modules", "digest", "pinned"} <= columns[
        "adapters"
    ]
    assert {"digest", "config", "weights", "size_bytes", "created_at"} <= columns["adapter_files"]
    assert {"actor_key_id", "action", "before", "after"} <= columns["audit_log"]


def _fetch(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        connection = await asyncpg.connect(url)
        try:
            return await connection.fetch(query, *args)
        finally:
            await connection.close()

    return asyncio.run(run())


def test_0004_moves_stored_adapters_into_postgres_and_leaves_missing_ones(database_url: str, tmp_path: Path) -> None:
    config, weights = b'{"r": 4, "peft_type": "LORA"}', b"\x00weights\xff" * 1000
    stored = tmp_path / "stored"
    stored.mkdir()
    (stored / "adapter_config.json").write_bytes(config)
    (stored / "adapter_model.safetensors").write_bytes(weights)
    digest = adapter_digest(config, weights)
    lost = "f" * 64
    command.downgrade(alembic_config(database_url), "0003")
    try:
        assert "adapter_files" not in _columns(database_url) and "pinned" not in _columns(database_url)["adapters"]
        tenant = uuid.uuid4()
        _fetch(database_url, "INSERT INTO tenants (id, name) VALUES ($1, 'acme')", tenant)
        for name, row_digest, folder in (("kept", digest, stored), ("again", digest, stored), ("lost", lost, tmp_path)):
            _fetch(
                database_url,
                "INSERT INTO adapters (id, tenant_id, name, base_model, rank, alpha, target_modules, digest, "
                "size_bytes, storage_path) VALUES ($1, $2, $3, 'base', 4, 8, '{q_proj}', $4, 1, $5)",
                uuid.uuid4(),
                tenant,
                name,
                row_digest,
                str(folder),
            )
        upgrade(database_url)
        files = _fetch(database_url, "SELECT digest, config, weights, size_bytes FROM adapter_files")
        assert [(f["digest"], f["config"], f["weights"], f["size_bytes"]) for f in files] == [
            (digest, config, weights, len(config) + len(weights))
        ]
        assert {r["pinned"] for r in _fetch(database_url, "SELECT pinned FROM adapters")} == {False}
    finally:
        upgrade(database_url)
        truncate_all(database_url)


def _upgrade_in_a_process(url: str) -> subprocess.Popen[str]:
    """A gateway's start-up migration, in a process of its own (as gateways are: Alembic's state is per process)."""
    code = "import json, sys; from app.db.migrate import upgrade; print(json.dumps(upgrade(sys.argv[1])))"
    return subprocess.Popen(
        [sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_gateways_upgrading_an_empty_database_together_apply_each_revision_once(postgres_url: str) -> None:
    name = f"race_{uuid.uuid4().hex[:12]}"
    _fetch(postgres_url, f"CREATE DATABASE {name}")
    empty = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    try:
        gateways = [_upgrade_in_a_process(empty) for _ in range(4)]  # four gateways starting at once
        applied = []
        for gateway in gateways:
            out, err = gateway.communicate(timeout=MIGRATION_TIMEOUT_S)
            assert gateway.returncode == 0, err[-3000:]
            applied.append(json.loads(out.splitlines()[-1]))
        every_revision = [revision for revisions in applied for revision in revisions]
        assert len(every_revision) == len(set(every_revision)), applied  # none applied twice
        known = {script.revision for script in ScriptDirectory.from_config(alembic_config(empty)).walk_revisions()}
        assert set(every_revision) == known, applied  # each applied once, by one of them
        assert upgrade(empty) == []
    finally:
        _fetch(postgres_url, f"DROP DATABASE {name} WITH (FORCE)")
