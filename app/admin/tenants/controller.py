"""Admin routes for tenants (docs/admin.md); the logic is in app/admin/tenants/service.py.

Creating, listing, changing and deleting tenants is the platform's (Access.PLATFORM); a tenant admin may read
its own tenant's record (Access.TENANT). The admin router's guard checks the key before the body is read.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Request, delete, get, patch, post
from litestar.openapi.spec import Example
from litestar.params import Body, Parameter

from app.admin.guards import ACCESS, Access, admin_of
from app.admin.tenants.schemas import TenantCreate, TenantList, TenantOut, TenantUpdate
from app.admin.tenants.service import TenantService
from app.services import gateway_of
from app.web.json_body import strict_json
from app.web.responses import error_responses

PLATFORM = {ACCESS: Access.PLATFORM}
TENANT = {ACCESS: Access.TENANT}


def tenant_service(request: Request) -> TenantService:
    gateway = gateway_of(request)
    return TenantService(gateway.database, gateway.resolver, gateway.adapters, gateway.authenticator)


TenantId = Annotated[uuid.UUID, Parameter(description="The tenant's id, as its creation returned it.")]


@post(
    "/tenants",
    opt=PLATFORM,
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
    return await tenant_service(request).create(admin_of(request), data)


@get(
    "/tenants",
    opt=PLATFORM,
    summary="List tenants",
    description="Every tenant, ordered by name; deleted tenants only with `include_deleted=true`.",
    tags=["admin"],
    responses=error_responses(400, 401, 403),
)
async def list_tenants(
    request: Request,
    include_deleted: Annotated[bool, Parameter(description="Also list deleted tenants.")] = False,
) -> TenantList:
    return await tenant_service(request).list_tenants(include_deleted)


@get(
    "/tenants/{tenant_id:uuid}",
    opt=TENANT,
    summary="Get a tenant",
    description="One tenant, deleted or not; 404 for an unknown id. A `tenant-admin` key reads its own tenant.",
    tags=["admin"],
    responses=error_responses(401, 403, 404),
)
async def get_tenant(request: Request, tenant_id: TenantId) -> TenantOut:
    return await tenant_service(request).get(tenant_id)


@patch(
    "/tenants/{tenant_id:uuid}",
    opt=PLATFORM,
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
    return await tenant_service(request).update(admin_of(request), tenant_id, data)


@delete(
    "/tenants/{tenant_id:uuid}",
    opt=PLATFORM,
    status_code=200,
    summary="Delete a tenant",
    description="Marks the tenant deleted (its row and usage stay for billing), revokes its keys and deletes its "
    "adapters; requests already running finish. Its name stays taken. Deleting it again changes nothing.",
    tags=["admin"],
    responses=error_responses(401, 403, 404, 409),
)
async def delete_tenant(request: Request, tenant_id: TenantId) -> TenantOut:
    return await tenant_service(request).delete(admin_of(request), tenant_id)


TENANT_ROUTES = [create_tenant, list_tenants, get_tenant, update_tenant, delete_tenant]
