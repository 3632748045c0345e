"""Creating and revoking API keys; the plaintext exists only in the return value of create_api_key."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.tables import ApiKey, Tenant
from app.keys.secrets import generate_api_key, hash_api_key
from app.web.errors import BadRequestError, NotFoundError

logger = logging.getLogger(__name__)


ADMIN_TENANT = "admin"
"""The tenant that holds the platform's administrators: ``admin`` keys are valid in it and nowhere else."""


class Scope:
    """What a key may do (docs/admin.md#scopes).

    ``inference``: the OpenAI-compatible API. ``admin``: all of ``/admin`` and the console, every tenant;
    valid only on keys of the ADMIN_TENANT. ``tenant-admin``: its own tenant's keys, adapters and usage;
    valid on keys of any other tenant. None implies another: an admin key cannot run completions unless it
    also has ``inference``.
    """

    INFERENCE = "inference"
    ADMIN = "admin"
    TENANT_ADMIN = "tenant-admin"
    VALID = frozenset({INFERENCE, ADMIN, TENANT_ADMIN})


def scope_refusal(scope: str, tenant_name: str) -> str | None:
    """Why a key of ``tenant_name`` cannot hold ``scope`` (a sentence saying what to do instead), or None if it can."""
    if scope == Scope.ADMIN and tenant_name != ADMIN_TENANT:
        return (
            f"The `{Scope.ADMIN}` scope administers every tenant, so only keys of the `{ADMIN_TENANT}` tenant may "
            f"hold it, not keys of `{tenant_name}`. Give this key the `{Scope.TENANT_ADMIN}` scope to manage "
            f"`{tenant_name}`'s keys, adapters and usage."
        )
    if scope == Scope.TENANT_ADMIN and tenant_name == ADMIN_TENANT:
        return (
            f"Keys of the `{ADMIN_TENANT}` tenant administer the platform: give this key the `{Scope.ADMIN}` scope, "
            f"or make the `{Scope.TENANT_ADMIN}` key in the tenant it should manage."
        )
    return None


async def create_api_key(
    session: AsyncSession,
    *,
    tenant_id: uuid.UUID,
    name: str,
    scopes: Iterable[str],
    key_secret: bytes,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Add a new key for the tenant to `session` and flush; return the row and the plaintext (shown once).

    The caller commits. Raises BadRequestError for no scopes, an unknown scope, a scope the tenant's keys
    cannot hold (``scope_refusal``), or an expiry that is not a timezone-aware time in the future;
    NotFoundError when the tenant does not exist.
    """
    scope_list = sorted(set(scopes))
    if not scope_list:
        raise BadRequestError(
            f"A key needs at least one scope; choose from {', '.join(sorted(Scope.VALID))}.", param="scopes"
        )
    unknown = [scope for scope in scope_list if scope not in Scope.VALID]
    if unknown:
        raise BadRequestError(
            f"Unknown scope {', '.join(repr(s) for s in unknown)}; valid scopes are {', '.join(sorted(Scope.VALID))}.",
            param="scopes",
        )
    if expires_at is not None:
        if expires_at.tzinfo is None:
            raise BadRequestError(
                "expires_at has no timezone; give it with an offset, e.g. 2030-01-01T00:00:00Z.", param="expires_at"
            )
        if expires_at <= datetime.now(UTC):
            raise BadRequestError(
                f"expires_at ({expires_at.isoformat()}) is in the past; give a time in the future, or none.",
                param="expires_at",
            )
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFoundError(f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.")
    for scope in scope_list:
        if (refusal := scope_refusal(scope, tenant.name)) is not None:
            raise BadRequestError(refusal, param="scopes", code="scope_not_allowed")

    generated = generate_api_key()
    key = ApiKey(
        tenant_id=tenant_id,
        name=name,
        prefix=generated.prefix,
        secret_hash=hash_api_key(key_secret, generated.plaintext),
        scopes=scope_list,
        expires_at=expires_at,
    )
    session.add(key)
    await session.flush()
    await session.refresh(key)  # loads created_at, which the database fills in
    logger.info("created API key %s (%s) for tenant %s with scopes %s", key.id, key.prefix, tenant_id, scope_list)
    return key, generated.plaintext


async def revoke_api_key(session: AsyncSession, key_id: uuid.UUID) -> ApiKey:
    """Mark the key revoked now and flush (the caller commits); authenticators refuse it within a second.

    Revoking a revoked key keeps its first revocation time. Raises NotFoundError for an unknown id.
    """
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise NotFoundError(
            f"No API key has the id {key_id}; list a tenant's keys with GET /admin/tenants/{{tenant_id}}/keys."
        )
    if key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
        await session.flush()
        logger.info("revoked API key %s (%s) of tenant %s", key.id, key.prefix, key.tenant_id)
    return key
