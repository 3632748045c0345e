"""One request's usage, as the request path hands it to the writer."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

import msgspec

UsageStatus = Literal["ok", "error", "cancelled"]


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The columns of one ``usage_events`` row (all but its serial ``id``); times are tz-aware UTC."""

    request_id: str
    tenant_id: uuid.UUID
    api_key_id: uuid.UUID | None
    adapter_id: uuid.UUID | None
    model: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: UsageStatus
    finish_reason: str | None
    started_at: datetime
    finished_at: datetime
    ttft_ms: float | None

    def __post_init__(self) -> None:
        # A naive time would be read as the server's local time and bill the wrong day.
        if self.started_at.tzinfo is None or self.finished_at.tzinfo is None:
            raise ValueError(f"usage record {self.request_id}: started_at and finished_at must be tz-aware (UTC)")
