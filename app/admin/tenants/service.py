"""Tenants for the admin API: create, list, read, change, disable and delete, each change audited.

Deleting a tenant is a soft delete: the row stays with status ``deleted`` because ``usage_events`` (the
billing record) points at it. What holds the tenant's data goes in the same transaction: its stored responses
are deleted and its adapters' chat templates cleared; its keys are revoked and its adapters marked deleted,
then removed from the engine and, unless another tenant's adapter has the same digest, from the file store
(app/admin/adapters/removal.py); requests already running finish first. A deleted tenant cannot be changed or
given keys, and its name stays taken for good, so usage reports and the audit log never show two tenants under
one name; choose a new name for a new tenant.

Every change to a tenant makes this process's authenticator forget the tenant's keys once it is
committed, so a disabled or deleted tenant's keys are refused from the very next request. A deletion is
also announced to the other replicas (``app/adapters/announcements.py``), which forget its keys and retire
its adapters at once; other changes reach them within their one-second cache.

The `admin` tenant cannot be disabled, deleted or renamed: it holds the platform's admin keys (the `admin`
scope is valid on its keys only), so any of these would leave nobody able to administer the server.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.adapters.announcements import Op, announce, announce_tenant_deleted
from app.adapters.resolver import ModelResolver
from app.admin.adapters.service import AdapterService
from app.admin.audit import record_change
from app.admin.tenants.schemas import TenantCreate, TenantList, TenantOut, TenantUpdate
from app.db.database import Database
from app.db.tables import Adapter, ApiKey, StoredResponse, Tenant
from app.keys.authenticator import Authenticator, Principal
from app.keys.service import ADMIN_TENANT
from app.web.errors import ConflictError, NotFoundError

logger = logging.getLogger(__name__)

TENANT = "tenant"  # audit_log.target_type
DELETED = "deleted"
LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent", "monthly_token_budget")


def tenant_out(tenant: Tenant) -> TenantOut:
    return TenantOut(
        id=tenant.id,
        name=tenant.name,
        status=tenant.status,  # type: ignore[arg-type]  # the check constraint keeps it to TenantStatus
        rpm_limit=tenant.rpm_limit,
        tpm_limit=tenant.tpm_limit,
        max_concurrent=tenant.max_concurrent,
        monthly_token_budget=tenant.monthly_token_budget,
        fair_share_weight=tenant.fair_share_weight,
        created_at=tenant.created_at,
    )


def audit_view(record: msgspec.Struct) -> dict[str, Any]:
    """A response body as the JSON object stored in audit_log.before/after."""
    return msgspec.to_builtins(record)


async def lock_tenant(session: AsyncSession, tenant_id: uuid.UUID) -> Tenant:
    """The tenant's row, locked until the transaction ends; NotFoundError for an unknown id."""
    tenant = await session.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None:
        raise NotFoundError(f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.")
    return tenant


def refuse_if_deleted(tenant: Tenant, what: str) -> None:
    if tenant.status == DELETED:
        raise ConflictError(f"The tenant `{tenant.name}` ({tenant.id}) is deleted, so {what}; create a new tenant.")


async def add_tenant(session: AsyncSession, actor: Principal | None, body: TenantCreate) -> Tenant:
    """Insert the tenant and its audit row in `session` (the caller commits); ConflictError if the name is taken."""
    await _refuse_taken_name(session, body.name)
    tenant = Tenant(
        name=body.name,
        status="active",
        fair_share_weight=body.fair_share_weight,
        **{name: getattr(body, name) for name in LIMIT_FIELDS},
    )
    session.add(tenant)
    try:
        async with session.begin_nested():
            await session.flush()
    except IntegrityError as error:  # another request took the name between the check and the insert
        raise _name_taken(body.name) from error
    await session.refresh(tenant)  # created_at, which the database fills in
    record_change(session, actor, "tenant.create", TENANT, tenant.id, None, audit_view(tenant_out(tenant)))
    logger.info("created tenant %s (%s)", tenant.name, tenant.id)
    return tenant


class TenantService:
    """The tenants side of the admin API; every change commits with its audit row."""

    def __init__(
        self, database: Database, resolver: ModelResolver, adapters: AdapterService, authenticator: Authenticator
    ) -> None:
        self.database = database
        self.resolver = resolver
        self.adapters = adapters
        self.authenticator = authenticator

    async def create(self, actor: Principal, body: TenantCreate) -> TenantOut:
        async with self.database.sessions() as session, session.begin():
            return tenant_out(await add_tenant(session, actor, body))

    async def list_tenants(self, include_deleted: bool = False) -> TenantList:
        query = select(Tenant).order_by(Tenant.name)
        if not include_deleted:
            query = query.where(Tenant.status != DELETED)
        async with self.database.sessions() as session:
            return TenantList(data=[tenant_out(tenant) for tenant in await session.scalars(query)])

    async def get(self, tenant_id: uuid.UUID) -> TenantOut:
        async with self.database.sessions() as session:
            tenant = await session.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFoundError(f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.")
            return tenant_out(tenant)

    async def update(self, actor: Principal, tenant_id: uuid.UUID, body: TenantUpdate) -> TenantOut:
        """Apply the fields that are set; a change that changes nothing writes no audit row."""
        changes = {name: value for name, value in msgspec.structs.asdict(body).items() if value is not msgspec.UNSET}
        async with self.database.sessions() as session, session.begin():
            tenant = await lock_tenant(session, tenant_id)
            refuse_if_deleted(tenant, "it cannot be changed")
            before = tenant_out(tenant)
            changes = {name: value for name, value in changes.items() if getattr(tenant, name) != value}
            if not changes:
                return before
            if changes.get("status") == "disabled":
                _refuse_admin_tenant(tenant, "disabled")
            if "name" in changes:
                _refuse_admin_tenant(tenant, "renamed")
                await _refuse_taken_name(session, changes["name"])
            for name, value in changes.items():
                setattr(tenant, name, value)
            try:
                async with session.begin_nested():
                    await session.flush()
            except IntegrityError as error:
                raise _name_taken(changes["name"]) from error
            after = tenant_out(tenant)
            record_change(session, actor, "tenant.update", TENANT, tenant.id, audit_view(before), audit_view(after))
        self.authenticator.forget_tenant(tenant.id)
        self.resolver.forget_tenant(tenant.id)
        logger.info("updated tenant %s (%s): %s", tenant.name, tenant.id, ", ".join(sorted(changes)))
        return after

    async def delete(self, actor: Principal, tenant_id: uuid.UUID) -> TenantOut:
        """Mark the tenant deleted, revoke its keys, delete its adapters and stored responses; again: nothing."""
        async with self.database.sessions() as session, session.begin():
            tenant = await lock_tenant(session, tenant_id)
            if tenant.status == DELETED:
                return tenant_out(tenant)
            _refuse_admin_tenant(tenant, "deleted")
            before = tenant_out(tenant)
            now = datetime.now(UTC)
            revoked_key_ids = list(
                await session.scalars(
                    update(ApiKey)
                    .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
                    .values(revoked_at=now)
                    .returning(ApiKey.id)
                )
            )
            adapters = (
                await session.execute(
                    update(Adapter)
                    .where(Adapter.tenant_id == tenant.id, Adapter.status != DELETED)
                    .values(status=DELETED)
                    .returning(Adapter.id, Adapter.name, Adapter.digest)
                )
            ).all()
            await session.execute(
                update(Adapter)
                .where(Adapter.tenant_id == tenant.id)
                .values(chat_template=None, chat_template_sha256=None)
            )
            num_responses = (
                await session.execute(delete(StoredResponse).where(StoredResponse.tenant_id == tenant.id))
            ).rowcount
            tenant.status = DELETED
            await session.flush()
            # Sent on commit, the tenant first: other replicas stop taking its keys, then retire its adapters.
            await announce_tenant_deleted(session, tenant.id)
            for adapter in adapters:
                await announce(session, Op.DELETE, adapter.id, adapter.digest)
            after = tenant_out(tenant)
            record_change(
                session,
                actor,
                "tenant.delete",
                TENANT,
                tenant.id,
                audit_view(before),
                audit_view(after)
                | {
                    "revoked_key_ids": sorted(str(key_id) for key_id in revoked_key_ids),
                    "deleted_adapter_ids": sorted(str(adapter.id) for adapter in adapters),
                    "deleted_stored_responses": num_responses,
                },
            )
        self.authenticator.forget_tenant(tenant.id)
        self.resolver.forget_tenant(tenant.id)
        logger.info(
            "deleted tenant %s (%s): %d keys revoked, %d adapters and %d stored responses deleted",
            tenant.name,
            tenant.id,
            len(revoked_key_ids),
            len(adapters),
            num_responses,
        )
        for adapter in adapters:
            await self.adapters.retire(adapter.id, adapter.digest)
        return after


async def _refuse_taken_name(session: AsyncSession, name: str) -> None:
    if await session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise _name_taken(name)


def _name_taken(name: str) -> ConflictError:
    return ConflictError(
        f"A tenant named `{name}` already exists (names of deleted tenants stay taken); choose another name.",
        param="name",
    )


def _refuse_admin_tenant(tenant: Tenant, done: str) -> None:
    if tenant.name == ADMIN_TENANT:
        raise ConflictError(
            f"The `{ADMIN_TENANT}` tenant cannot be {done}: it holds the platform's admin keys, and the `admin` "
            "scope is valid on its keys only. Revoke single admin keys instead (DELETE /admin/keys/{key_id})."
        )
