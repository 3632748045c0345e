"""The first admin key, made on the machine itself: by ``loraplex admin create-key`` or from LORAPLEX_ADMIN_KEY.

Both put the key in the tenant named ``admin``, the only tenant whose keys may hold the `admin` scope
(created when missing, made active again when disabled or deleted), and write audit rows with no actor (a
change made locally, not through the API).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import any_, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from app.admin.audit import record_change
from app.admin.keys.service import API_KEY, key_out, store_api_key
from app.admin.tenants.schemas import TenantCreate
from app.admin.tenants.service import TENANT, add_tenant, audit_view, tenant_out
from app.db.database import Database
from app.db.tables import ApiKey, Tenant
from app.keys.secrets import (
    KEY_ID_LENGTH,
    KEY_SECRET_LENGTH,
    KEY_TAG,
    MalformedApiKeyError,
    hash_api_key,
    key_prefix,
)
from app.keys.service import ADMIN_TENANT, Scope, create_api_key
from app.settings import SettingsError

logger = logging.getLogger(__name__)

ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
# Serialises first starts of several gateways on one database, so only one of them stores the key.
ADMIN_KEY_LOCK_ID = 0x6C70785F61646D  # "lpx_adm"; any constant distinct from other advisory locks


class AdminKeyError(SettingsError):
    """LORAPLEX_ADMIN_KEY is not a loraplex key."""


async def create_admin_key(database: Database, key_secret: bytes, name: str = "admin") -> str:
    """A new key with the `admin` scope in the `admin` tenant; return its plaintext (shown once, stored nowhere)."""
    async with database.sessions() as session, session.begin():
        tenant = await _admin_tenant(session)
        key, plaintext = await create_api_key(
            session, tenant_id=tenant.id, name=name, scopes=[Scope.ADMIN], key_secret=key_secret
        )
        record_change(session, None, "key.create", API_KEY, key.id, None, audit_view(key_out(key)))
    logger.info("created admin key %s (%s) in the `%s` tenant", key.id, key.prefix, ADMIN_TENANT)
    return plaintext


async def ensure_admin_key(database: Database, key_secret: bytes, plaintext: str) -> bool:
    """Store `plaintext` (LORAPLEX_ADMIN_KEY) as an admin key if no usable admin key exists; True if stored.

    Usable: not revoked, not expired, of the active `admin` tenant. A value stored before is never stored again, so
    revoking it (or rotating it away) sticks across restarts. Raises AdminKeyError for a malformed value.
    """
    try:
        key_prefix(plaintext)
    except MalformedApiKeyError:
        raise AdminKeyError(
            f"{ADMIN_KEY_ENV} is not a loraplex API key: keys look like {KEY_TAG}_<{KEY_ID_LENGTH} lowercase letters "
            f"or digits>_<{KEY_SECRET_LENGTH} letters, digits, '-' or '_'>. Unset it and run `loraplex admin "
            "create-key` to make an admin key, or set it to a key in that format."
        ) from None
    async with database.sessions() as session, session.begin():
        await session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": ADMIN_KEY_LOCK_ID})
        stored = await session.scalar(select(ApiKey).where(ApiKey.secret_hash == hash_api_key(key_secret, plaintext)))
        if stored is not None:
            if stored.revoked_at is not None:
                logger.warning(
                    "%s is the key %s, revoked at %s; it stays revoked. Unset it, or set a new key.",
                    ADMIN_KEY_ENV,
                    stored.prefix,
                    stored.revoked_at.isoformat(),
                )
            return False
        if await _usable_admin_keys(session) > 0:
            logger.info("an admin key exists, so %s is not stored", ADMIN_KEY_ENV)
            return False
        tenant = await _admin_tenant(session)
        key = await store_api_key(
            session,
            tenant_id=tenant.id,
            name=ADMIN_KEY_ENV,
            scopes=[Scope.ADMIN],
            key_secret=key_secret,
            plaintext=plaintext,
        )
        record_change(session, None, "key.create", API_KEY, key.id, None, audit_view(key_out(key)))
    logger.info("stored %s as admin key %s (%s) in the `%s` tenant", ADMIN_KEY_ENV, key.id, key.prefix, ADMIN_TENANT)
    return True


async def warn_of_void_admin_keys(database: Database) -> int:
    """Log the live keys that hold `admin` outside the `admin` tenant (the API refuses them that scope); how many.

    Earlier versions let any tenant's key hold it; such keys now administer nothing (the authenticator does not
    count the scope), and this warning at each start says which they are and what to do.
    """
    query = (
        select(ApiKey.prefix, Tenant.name)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(any_(ApiKey.scopes) == Scope.ADMIN, Tenant.name != ADMIN_TENANT, ApiKey.revoked_at.is_(None))
        .order_by(Tenant.name, ApiKey.prefix)
    )
    async with database.sessions() as session:
        void = (await session.execute(query)).all()
    if void:
        logger.warning(
            "%d API key(s) hold the `admin` scope outside the `%s` tenant, where it counts for nothing: %s. Revoke "
            "them (`loraplex keys revoke KEY_ID`), and give each tenant that needs one a `tenant-admin` key.",
            len(void),
            ADMIN_TENANT,
            ", ".join(f"{prefix} of {tenant}" for prefix, tenant in void),
        )
    return len(void)


async def _admin_tenant(session: AsyncSession) -> Tenant:
    """The active `admin` tenant, created or made active again (with its audit row) when needed.

    The API refuses to disable or delete it; a database where it was done before gets it back here, its old
    keys still revoked.
    """
    tenant = await session.scalar(select(Tenant).where(Tenant.name == ADMIN_TENANT).with_for_update())
    if tenant is None:
        return await add_tenant(session, None, TenantCreate(name=ADMIN_TENANT))
    if tenant.status != "active":
        before = tenant_out(tenant)
        tenant.status = "active"
        await session.flush()
        after = tenant_out(tenant)
        record_change(session, None, "tenant.update", TENANT, tenant.id, audit_view(before), audit_view(after))
        logger.warning("the `%s` tenant was %s; it is active again for its new admin key", ADMIN_TENANT, before.status)
    return tenant


async def _usable_admin_keys(session: AsyncSession) -> int:
    query = (
        select(func.count())
        .select_from(ApiKey)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            any_(ApiKey.scopes) == Scope.ADMIN,
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > datetime.now(UTC)),
            Tenant.status == "active",
            Tenant.name == ADMIN_TENANT,  # the only tenant whose keys' `admin` scope is valid
        )
    )
    return await session.scalar(query) or 0
