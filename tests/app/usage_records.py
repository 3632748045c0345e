"""Usage records for the writer's tests, each field varied by its index."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from app.usage.records import UsageRecord


def usage_record(tenant_id: uuid.UUID, request_id: str, index: int = 0) -> UsageRecord:
    started_at = datetime(2025, 3, 1, 12, 0, tzinfo=UTC) + timedelta(seconds=index, microseconds=index)
    return UsageRecord(
        request_id=request_id,
        tenant_id=tenant_id,
        api_key_id=None,
        adapter_id=None,
        model="SmolLM2-135M-Instruct",
        prompt_tokens=100 + index,
        cached_prompt_tokens=index % 64,
        completion_tokens=7 * index + 1,
        status=("ok", "error", "cancelled")[index % 3],
        finish_reason="length" if index % 2 else None,
        started_at=started_at,
        finished_at=started_at + timedelta(milliseconds=250 + index),
        ttft_ms=12.5 + index / 7 if index % 5 else None,
    )
