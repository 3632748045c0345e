"""The migrations build the schema of DESIGN.md §7 that billing jobs read."""

from __future__ import annotations

import asyncio

import asyncpg

from app.db.migrate import upgrade


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
    assert {"id", "tenant_id", "name", "base_model", "rank", "alpha", "target_modules", "digest"} <= columns["adapters"]
    assert {"actor_key_id", "action", "before", "after"} <= columns["audit_log"]
