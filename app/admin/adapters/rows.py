"""Rows of the adapters table as the admin adapter services see them: their statuses, their view in the API,
and the 404s of an unknown adapter or tenant."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncSession

from app.admin.adapters.schemas import AdapterOut
from app.db.tables import Adapter, Tenant
from app.engine_clients.interface import EngineClient
from app.web.errors import NotFoundError

READY = "ready"
DELETED = "deleted"
TENANT_DELETED = "deleted"  # a deleted tenant keeps its row for its usage; its adapters are out of reach


def adapter_out(row: Adapter, engine: EngineClient) -> AdapterOut:
    """The row as the API shows it, with whether this replica's engine holds the adapter now."""
    return AdapterOut.of(row, loaded=engine.has_adapter(str(row.id)), pinned=row.pinned)


async def require_tenant(session: AsyncSession, tenant_id: uuid.UUID) -> None:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None or tenant.status == TENANT_DELETED:
        raise NotFoundError(
            f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.", param="tenant_id"
        )


def no_adapter(adapter_id: uuid.UUID) -> NotFoundError:
    return NotFoundError(
        f"No adapter has the id {adapter_id}; list a tenant's adapters with GET /admin/tenants/{{tenant_id}}/adapters.",
        param="adapter_id",
    )
