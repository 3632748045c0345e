"""Console pages for tenants: the list, creating one, its limits and weight, suspending and deleting it.

All are the platform's (Access.PLATFORM) but the console's home, which sends each key to its own start page.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from litestar import Request, Response, get, post
from litestar.response import Redirect
from litestar.status_codes import HTTP_303_SEE_OTHER

from app.admin.adapters.controller import TenantId
from app.admin.guards import ACCESS, Access, admin_of, caller_of
from app.admin.tenants.controller import tenant_service
from app.admin.tenants.schemas import TenantCreate, TenantUpdate
from app.admin.tenants.service import LIMIT_FIELDS
from app.console.access import home_of
from app.console.forms import FormError, convert, form_values, limit_changes
from app.console.pages import render, see_other
from app.web.errors import ApiError

CREATE_FIELDS = ("name", *LIMIT_FIELDS, "fair_share_weight")
PLATFORM = {ACCESS: Access.PLATFORM}


async def _list_page(
    request: Request, *, error: str | None = None, status_code: int = 200, form: Mapping[str, Any] | None = None
) -> Response:
    show_deleted = request.query_params.get("deleted") == "1"
    tenants = (await tenant_service(request).list_tenants(include_deleted=show_deleted)).data
    return render(
        request,
        "tenants.html",
        status_code=status_code,
        tenants=tenants,
        show_deleted=show_deleted,
        error=error,
        form=form or {},
        nav="tenants",
    )


@get("/", opt={ACCESS: Access.OWN_TENANT}, include_in_schema=False)
async def console_home(request: Request) -> Redirect:
    return Redirect(home_of(caller_of(request)), status_code=HTTP_303_SEE_OTHER)


@get("/tenants", opt=PLATFORM, include_in_schema=False)
async def tenants_page(request: Request) -> Response:
    return await _list_page(request)


@post("/tenants", opt=PLATFORM, include_in_schema=False)
async def create_tenant(request: Request) -> Response:
    form = await request.form()
    try:
        body = convert(form_values(form, CREATE_FIELDS), TenantCreate)
        tenant = await tenant_service(request).create(admin_of(request), body)
    except (FormError, ApiError) as error:
        return await _list_page(request, error=error.message, status_code=error.status, form=dict(form))
    return see_other(f"/console/tenants/{tenant.id}", f"Created the tenant {tenant.name}.", request)


async def _tenant_page(
    request: Request, tenant_id: TenantId, *, error: str | None = None, status_code: int = 200
) -> Response:
    tenant = await tenant_service(request).get(tenant_id)
    return render(request, "tenant.html", status_code=status_code, tenant=tenant, error=error, nav="tenants")


@get("/tenants/{tenant_id:uuid}", opt=PLATFORM, include_in_schema=False)
async def tenant_page(request: Request, tenant_id: TenantId) -> Response:
    return await _tenant_page(request, tenant_id)


@post("/tenants/{tenant_id:uuid}", opt=PLATFORM, include_in_schema=False)
async def update_tenant(request: Request, tenant_id: TenantId) -> Response:
    """The limits and weight form: every limit it sends is set (blank: unlimited)."""
    form = await request.form()
    try:
        values: dict[str, object] = {**limit_changes(form), **form_values(form, ("fair_share_weight",))}
        body = convert(values, TenantUpdate)
        await tenant_service(request).update(admin_of(request), tenant_id, body)
    except (FormError, ApiError) as error:
        return await _tenant_page(request, tenant_id, error=error.message, status_code=error.status)
    return see_other(f"/console/tenants/{tenant_id}", "Saved the limits and weight.", request)


@post("/tenants/{tenant_id:uuid}/status", opt=PLATFORM, include_in_schema=False)
async def set_tenant_status(request: Request, tenant_id: TenantId) -> Response:
    """Suspend (``disabled``: its keys are refused) or resume (``active``) the tenant."""
    form = await request.form()
    try:
        body = convert(form_values(form, ("status",)), TenantUpdate)
        tenant = await tenant_service(request).update(admin_of(request), tenant_id, body)
    except (FormError, ApiError) as error:
        return await _tenant_page(request, tenant_id, error=error.message, status_code=error.status)
    done = "Suspended" if tenant.status == "disabled" else "Resumed"
    return see_other(f"/console/tenants/{tenant_id}", f"{done} the tenant {tenant.name}.", request)


@get("/tenants/{tenant_id:uuid}/delete", opt=PLATFORM, include_in_schema=False)
async def confirm_delete_tenant(request: Request, tenant_id: TenantId) -> Response:
    tenant = await tenant_service(request).get(tenant_id)
    return render(request, "tenant_delete.html", tenant=tenant, error=None, nav="tenants")


@post("/tenants/{tenant_id:uuid}/delete", opt=PLATFORM, include_in_schema=False)
async def delete_tenant(request: Request, tenant_id: TenantId) -> Response:
    """Delete the tenant once its name is typed back (a confirmation a stray click or Enter cannot give)."""
    service = tenant_service(request)
    tenant = await service.get(tenant_id)
    form = await request.form()
    if form.get("confirm_name") != tenant.name:
        message = f"Type the tenant's name, {tenant.name}, to confirm; nothing was deleted."
        return render(request, "tenant_delete.html", status_code=400, tenant=tenant, error=message, nav="tenants")
    try:
        await service.delete(admin_of(request), tenant_id)
    except ApiError as error:
        return render(
            request, "tenant_delete.html", status_code=error.status, tenant=tenant, error=error.message, nav="tenants"
        )
    return see_other("/console/tenants", f"Deleted the tenant {tenant.name}: its keys are revoked.", request)


TENANT_ROUTES = [
    console_home,
    tenants_page,
    create_tenant,
    tenant_page,
    update_tenant,
    set_tenant_status,
    confirm_delete_tenant,
    delete_tenant,
]
