"""Request and response bodies of the admin API for tenants and their keys, as msgspec Structs.

Requests forbid unknown fields, so a misspelt field is a 400 naming it rather than a change silently
not made. Constraints sit on the fields (``msgspec.Meta``), so a bad value is a 400 naming the field
before any handler runs, and the OpenAPI schema shows them.

In :class:`TenantUpdate` and :class:`KeyUpdate` a field left out is ``msgspec.UNSET`` (keep the value)
while an explicit ``null`` clears a limit (unlimited; for a key: only the tenant's limit applies).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

MAX_INT32 = 2**31 - 1  # rpm, tpm and concurrency limits are INTEGER columns
MAX_INT64 = 2**63 - 1  # the monthly token budget is a BIGINT column
MAX_GRACE_PERIOD_S = 30 * 24 * 3600  # a rotated key lives on for at most 30 days: long enough for any rollout
# Beyond a thousand to one, the lighter tenant waits behind every request of the heavier one anyway.
MAX_FAIR_SHARE_WEIGHT = 1000.0

TenantName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        # Names show up in metrics labels, logs and shell commands: keep them to one plain word.
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Unique name: 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit.",
    ),
]
KeyName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=128,
        pattern=r"^[^\x00]*$",  # PostgreSQL text cannot hold NUL
        description="A label for people, e.g. 'ci' or 'backend'.",
    ),
]
RateLimit = Annotated[int, Meta(ge=0, le=MAX_INT32, description="A whole number from 0; null is unlimited.")]
TokenBudget = Annotated[int, Meta(ge=0, le=MAX_INT64, description="Tokens a month, from 0; null is unlimited.")]
FairShareWeight = Annotated[
    float,
    Meta(
        gt=0,
        le=MAX_FAIR_SHARE_WEIGHT,
        description="The tenant's share of the engine when tenants compete for it, relative to the others' "
        "(default 1; 2 gets twice the tokens of a tenant of weight 1).",
    ),
]
# msgspec also reads a time without an offset, which the key service refuses (400 naming it); the schema says so.
ExpiresAt = Annotated[
    datetime,
    Meta(
        extra_json_schema={
            "format": "date-time",
            "description": "In the future, with its offset: 2030-01-01T00:00:00Z.",
        }
    ),
]
KeyScope = Literal["inference", "admin", "tenant-admin"]
TenantStatus = Literal["active", "disabled", "deleted"]


class TenantCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A new tenant; a limit left out or null means unlimited."""

    name: TenantName
    rpm_limit: RateLimit | None = None
    tpm_limit: RateLimit | None = None
    max_concurrent: RateLimit | None = None
    monthly_token_budget: TokenBudget | None = None
    fair_share_weight: FairShareWeight = 1.0


class TenantUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields to change; a field left out keeps its value, a limit set to null becomes unlimited."""

    name: TenantName | UnsetType = UNSET
    status: Literal["active", "disabled"] | UnsetType = UNSET
    rpm_limit: RateLimit | UnsetType | None = UNSET
    tpm_limit: RateLimit | UnsetType | None = UNSET
    max_concurrent: RateLimit | UnsetType | None = UNSET
    monthly_token_budget: TokenBudget | UnsetType | None = UNSET
    fair_share_weight: FairShareWeight | UnsetType = UNSET


class TenantOut(msgspec.Struct, kw_only=True):
    """A tenant; a limit of null means unlimited."""

    id: uuid.UUID
    name: str
    status: TenantStatus
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrent: int | None
    monthly_token_budget: int | None
    fair_share_weight: float
    created_at: datetime


class TenantList(msgspec.Struct, kw_only=True):
    data: list[TenantOut]


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A new key for a tenant; without ``expires_at`` it works until revoked.

    A limit set here narrows the tenant's for this key (the tenant's still holds across all its keys); left out
    or null, only the tenant's applies.
    """

    name: KeyName
    scopes: Annotated[list[KeyScope], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["inference"])
    expires_at: ExpiresAt | None = None
    rpm_limit: RateLimit | None = None
    tpm_limit: RateLimit | None = None
    max_concurrent: RateLimit | None = None
    monthly_token_budget: TokenBudget | None = None


class KeyUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The key's limits to change; a limit left out keeps its value, one set to null leaves only the tenant's."""

    rpm_limit: RateLimit | UnsetType | None = UNSET
    tpm_limit: RateLimit | UnsetType | None = UNSET
    max_concurrent: RateLimit | UnsetType | None = UNSET
    monthly_token_budget: TokenBudget | UnsetType | None = UNSET


class KeyRotate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How long the old key keeps working after its replacement is issued."""

    grace_period_s: Annotated[int, Meta(ge=0, le=MAX_GRACE_PERIOD_S)] = 3600


class KeyOut(msgspec.Struct, kw_only=True):
    """A key as listings show it: its prefix, never its secret nor the secret's hash."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrent: int | None
    monthly_token_budget: int | None


class KeyList(msgspec.Struct, kw_only=True):
    data: list[KeyOut]


class KeyCreated(msgspec.Struct, kw_only=True):
    """A key just made; ``key`` is its plaintext, shown in this response only and stored nowhere."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrent: int | None
    monthly_token_budget: int | None
    key: str
