"""API keys for the admin API: issue, list, limit, revoke and rotate, each change audited without its secret.

Rotation issues a new key with the same tenant, name, scopes and limits (and no expiry) and lets the old
key work for a grace period: its expiry becomes the earlier of the one it had and now + the grace. Revoking,
rotating or changing a key's limits is seen by this process from the next request (the service makes its
authenticator forget the key once committed) and by every other gateway within a second (their caches).
A key's limits narrow its tenant's; null leaves only the tenant's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.admin.audit import record_change
from app.admin.tenants.schemas import KeyCreate, KeyCreated, KeyList, KeyOut, KeyRotate, KeyUpdate
from app.admin.tenants.service import LIMIT_FIELDS, audit_view, refuse_if_deleted
from app.db.database import Database
from app.db.tables import ApiKey, Tenant
from app.keys.authenticator import Authenticator, Principal
from app.keys.secrets import hash_api_key, key_prefix
from app.keys.service import create_api_key, revoke_api_key
from app.web.errors import ConflictError, NotFoundError

logger = logging.getLogger(__name__)

API_KEY = "api_key"  # audit_log.target_type


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(
        id=key.id,
        tenant_id=key.tenant_id,
        name=key.name,
        prefix=key.prefix,
        scopes=list(key.scopes),
        created_at=key.created_at,
        expires_at=key.expires_at,
        revoked_at=key.revoked_at,
        last_used_at=key.last_used_at,
        rpm_limit=key.rpm_limit,
        tpm_limit=key.tpm_limit,
        max_concurrent=key.max_concurrent,
        monthly_token_budget=key.monthly_token_budget,
    )


def key_created(key: ApiKey, plaintext: str) -> KeyCreated:
    """The key as listed, less what a new key cannot have yet, plus its plaintext (this once)."""
    listed = msgspec.structs.asdict(key_out(key))
    return KeyCreated(**{name: listed[name] for name in KeyCreated.__struct_fields__ if name in listed}, key=plaintext)


async def store_api_key(
    session: AsyncSession, *, tenant_id: uuid.UUID, name: str, scopes: Iterable[str], key_secret: bytes, plaintext: str
) -> ApiKey:
    """Add a key whose plaintext the caller chose (LORAPLEX_ADMIN_KEY) and flush; the caller commits.

    Raises MalformedApiKeyError when `plaintext` is not in the ``lpx_<id>_<secret>`` format.
    """
    key = ApiKey(
        tenant_id=tenant_id,
        name=name,
        prefix=key_prefix(plaintext),
        secret_hash=hash_api_key(key_secret, plaintext),
        scopes=sorted(set(scopes)),
    )
    session.add(key)
    await session.flush()
    await session.refresh(key)  # created_at, which the database fills in
    logger.info("stored API key %s (%s) for tenant %s with scopes %s", key.id, key.prefix, tenant_id, key.scopes)
    return key


class KeyService:
    """The keys side of the admin API; every change commits with its audit row."""

    def __init__(self, database: Database, key_secret: bytes, authenticator: Authenticator) -> None:
        self.database = database
        self.key_secret = key_secret
        self.authenticator = authenticator

    async def create(self, actor: Principal, tenant_id: uuid.UUID, body: KeyCreate) -> KeyCreated:
        async with self.database.sessions() as session, session.begin():
            # Shared lock: a key is never added to a tenant that is being deleted (its sweep would miss it).
            tenant = await session.get(Tenant, tenant_id, with_for_update={"read": True})
            if tenant is None:
                raise NotFoundError(f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.")
            refuse_if_deleted(tenant, "it cannot be given keys")
            key, plaintext = await create_api_key(
                session,
                tenant_id=tenant.id,
                name=body.name,
                scopes=body.scopes,
                key_secret=self.key_secret,
                expires_at=body.expires_at,
            )
            await _set_limits(session, key, {name: getattr(body, name) for name in LIMIT_FIELDS})
            record_change(session, actor, "key.create", API_KEY, key.id, None, audit_view(key_out(key)))
            return key_created(key, plaintext)

    async def list_keys(self, tenant_id: uuid.UUID) -> KeyList:
        """The tenant's keys, revoked ones included, oldest first."""
        async with self.database.sessions() as session:
            if await session.get(Tenant, tenant_id) is None:
                raise NotFoundError(f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.")
            keys = await session.scalars(
                select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
            )
            return KeyList(data=[key_out(key) for key in keys])

    async def update(self, actor: Principal, key_id: uuid.UUID, body: KeyUpdate) -> KeyOut:
        """Change the limits that are set; a change that changes nothing writes no audit row."""
        changes = {name: value for name, value in msgspec.structs.asdict(body).items() if value is not msgspec.UNSET}
        async with self.database.sessions() as session, session.begin():
            key = await _lock_key(session, key_id)
            if key.revoked_at is not None:
                raise ConflictError(
                    f"The API key {key.prefix} ({key.id}) is revoked, so its limits cannot be changed; create a new "
                    f"key with POST /admin/tenants/{key.tenant_id}/keys."
                )
            before = key_out(key)
            changes = {name: value for name, value in changes.items() if getattr(key, name) != value}
            if not changes:
                return before
            await _set_limits(session, key, changes)
            after = key_out(key)
            record_change(session, actor, "key.update", API_KEY, key.id, audit_view(before), audit_view(after))
        self.authenticator.forget_key(key.id)
        logger.info("changed the limits of API key %s (%s): %s", key.id, key.prefix, ", ".join(sorted(changes)))
        return after

    async def revoke(self, actor: Principal, key_id: uuid.UUID) -> KeyOut:
        """Revoke the key; revoking a revoked key returns it unchanged and writes no audit row."""
        async with self.database.sessions() as session, session.begin():
            key = await _lock_key(session, key_id)
            if key.revoked_at is not None:
                return key_out(key)
            before = key_out(key)
            after = key_out(await revoke_api_key(session, key.id))
            record_change(session, actor, "key.revoke", API_KEY, key.id, audit_view(before), audit_view(after))
        self.authenticator.forget_key(key.id)
        return after

    async def rotate(self, actor: Principal, key_id: uuid.UUID, body: KeyRotate) -> KeyCreated:
        """Issue the key's successor; the old key works until now + the grace period (or its earlier expiry)."""
        async with self.database.sessions() as session, session.begin():
            old = await _lock_key(session, key_id)
            if old.revoked_at is not None:
                raise ConflictError(
                    f"The API key {old.prefix} ({old.id}) is revoked, so it cannot be rotated; create a new key with "
                    f"POST /admin/tenants/{old.tenant_id}/keys."
                )
            tenant = await session.get(Tenant, old.tenant_id, with_for_update={"read": True})
            assert tenant is not None  # the foreign key guarantees it
            refuse_if_deleted(tenant, "its keys cannot be rotated")
            before = key_out(old)
            new, plaintext = await create_api_key(
                session, tenant_id=old.tenant_id, name=old.name, scopes=old.scopes, key_secret=self.key_secret
            )
            await _set_limits(session, new, {name: getattr(old, name) for name in LIMIT_FIELDS})
            grace_end = datetime.now(UTC) + timedelta(seconds=body.grace_period_s)
            old.expires_at = grace_end if old.expires_at is None else min(old.expires_at, grace_end)
            await session.flush()
            after = audit_view(key_out(old)) | {"replaced_by": audit_view(key_out(new))}
            record_change(session, actor, "key.rotate", API_KEY, old.id, audit_view(before), after)
        self.authenticator.forget_key(old.id)  # its new expiry (now + the grace) holds from the next request
        logger.info("rotated API key %s (%s) to %s (%s)", old.id, old.prefix, new.id, new.prefix)
        return key_created(new, plaintext)


async def _set_limits(session: AsyncSession, key: ApiKey, limits: dict[str, int | None]) -> None:
    for name, value in limits.items():
        setattr(key, name, value)
    await session.flush()


async def _lock_key(session: AsyncSession, key_id: uuid.UUID) -> ApiKey:
    key = await session.get(ApiKey, key_id, with_for_update=True)
    if key is None:
        raise NotFoundError(
            f"No API key has the id {key_id}; list a tenant's keys with GET /admin/tenants/{{tenant_id}}/keys."
        )
    return key
