"""Admin routes for tenants (docs/admin.md); the logic is in app/admin/tenant_service.py.

Every route checks the caller's key with the ``admin_only`` guard, which runs before the body is read:
a caller without an admin key gets its 401 or 403 whatever it sent, and learns nothing about the body.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Request, delete, get, patch, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import Example
from litestar.params import Body, Parameter

from app.admin.guards import require_admin
from app.admin.schemas_tenants import TenantCreate, TenantList, TenantOut, TenantUpdate
from app.admin.tenant_service import TenantService
from app.keys.authenticator import Principal
from app.services import gateway_of
from app.web.json_body import strict_json
from app.web.responses import error_responses

ADMIN_STATE = "admin"  # where admin_only leaves the caller, in the request's state


async def admin_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: 401/403 unless the key has the `admin` scope; the caller is kept for the handler."""
    connection.state[ADMIN_STATE] = await require_admin(connection)  # type: ignore[arg-type]  # uses only headers


def admin_of(request: Request) -> Principal:
    """The caller that ``admin_only`` let through."""
    return request.state[ADMIN_STATE]


def _tenants(request: Request) -> TenantService:
    gateway = gateway_of(request)
    return TenantService(gateway.database, gateway.resolver, gateway.adapters, gateway.authenticator)


TenantId = Annotated[uuid.UUID, Parameter(description="The tenant's id, as its creation returned it.")]


@post(
    "/admin/tenants",
    guards=[admin_only],
    summary="Create a tenant",
    description="Creates an active tenant. Limits left out or null are unlimited. A name already used, also by a "
    "deleted tenant, is a 409.",
    tags=["admin"],
    before_request=strict_json(TenantCreate),
    responses=error_responses(400, 401, 403, 409, 413),
)
async def create_tenant(
    request: Request,
    data: Annotated[
        TenantCreate,
        Body(
            title="New tenant",
            examples=[
                Example(summary="Unlimited", value={"name": "acme"}),
                Example(
                    summary="With limits",
                    value={"name": "globex", "rpm_limit": 600, "tpm_limit": 200000, "fair_share_weight": 2.0},
                ),
            ],
        ),
    ],
) -> TenantOut:
    return await _tenants(request).create(admin_of(request), data)


@get(
    "/admin/tenants",
    guards=[admin_only],
    summary="List tenants",
    description="Every tenant, ordered by name; deleted tenants only with `include_deleted=true`.",
    tags=["admin"],
    responses=error_responses(400, 401, 403),
)
async def list_tenants(
    request: Request,
    include_deleted: Annotated[bool, Parameter(description="Also list deleted tenants.")] = False,
) -> TenantList:
    return await _tenants(request).list_tenants(include_deleted)


@get(
    "/admin/tenants/{tenant_id:uuid}",
    guards=[admin_only],
    summary="Get a tenant",
    description="One tenant, deleted or not; 404 for an unknown id.",
    tags=["admin"],
    responses=error_responses(401, 403, 404),
)
async def get_tenant(request: Request, tenant_id: TenantId) -> TenantOut:
    return await _tenants(request).get(tenant_id)


@patch(
    "/admin/tenants/{tenant_id:uuid}",
    guards=[admin_only],
    summary="Change a tenant",
    description="Changes the fields given and keeps the others; a limit set to null becomes unlimited. Limits and "
    "`fair_share_weight` hold within a second. "
    "`status: disabled` refuses the tenant's keys within a second, `active` accepts them again. "
    "A deleted tenant cannot be changed (409).",
    tags=["admin"],
    before_request=strict_json(TenantUpdate),
    responses=error_responses(400, 401, 403, 404, 409, 413),
)
async def update_tenant(
    request: Request,
    tenant_id: TenantId,
    data: Annotated[
        TenantUpdate,
        Body(
            title="Tenant changes",
            examples=[
                Example(summary="Disable", value={"status": "disabled"}),
                Example(summary="Change limits", value={"rpm_limit": 120, "monthly_token_budget": 50000000}),
                Example(summary="Twice the share of the engine", value={"fair_share_weight": 2.0}),
            ],
        ),
    ],
) -> TenantOut:
    return await _tenants(request).update(admin_of(request), tenant_id, data)


@delete(
    "/admin/tenants/{tenant_id:uuid}",
    guards=[admin_only],
    status_code=200,
    summary="Delete a tenant",
    description="Marks the tenant deleted (its row and usage stay for billing), revokes its keys and deletes its "
    "adapters; requests already running finish. Its name stays taken. Deleting it again changes nothing.",
    tags=["admin"],
    responses=error_responses(401, 403, 404, 409),
)
async def delete_tenant(request: Request, tenant_id: TenantId) -> TenantOut:
    return await _tenants(request).delete(admin_of(request), tenant_id)


TENANT_ROUTES = [create_tenant, list_tenants, get_tenant, update_tenant, delete_tenant]
