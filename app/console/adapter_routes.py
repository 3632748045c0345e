"""Console pages for a tenant's adapters: upload (drag and drop), pin, unload, delete, and where each one lives.

Each is Access.TENANT (a tenant admin's own adapters) but unload, the platform's, as in the admin API.
"""

from __future__ import annotations

from litestar import MediaType, Request, Response, get, post

from app.admin.adapters.controller import AdapterId, TenantId, adapter_service
from app.admin.guards import ACCESS, Access, admin_of
from app.admin.tenants.controller import tenant_service
from app.console.access import session_of
from app.console.pages import render, see_other
from app.web.errors import ApiError


def residency(pinned: bool, loaded: bool) -> str:
    """Where the adapter's weights are: kept in the engine's page pool, in the engine's host cache, or only stored."""
    if pinned:
        return "pinned in the pool"
    if loaded:
        return "in the engine (host cache)"
    return "stored (loaded on first use)"


TENANT = {ACCESS: Access.TENANT}


@get("/tenants/{tenant_id:uuid}/adapters", opt=TENANT, include_in_schema=False)
async def adapters_page(request: Request, tenant_id: TenantId) -> Response:
    tenant = await tenant_service(request).get(tenant_id)
    adapters = (await adapter_service(request).list_for_tenant(tenant_id)).data
    return render(request, "adapters.html", tenant=tenant, adapters=adapters, residency=residency, nav="tenants")


@post(
    "/tenants/{tenant_id:uuid}/adapters",
    opt=TENANT,
    include_in_schema=False,
    request_max_body_size=None,  # the upload counts its own bytes against LORAPLEX_MAX_ADAPTER_MB as they arrive
)
async def upload_adapter(request: Request, tenant_id: TenantId) -> Response:
    """The admin API's upload, streamed as is; the page's script shows the answer's text next to the drop zone."""
    try:
        adapter = await adapter_service(request).upload(
            admin_of(request), tenant_id, request.stream(), request.headers.get("content-type"), request.content_length
        )
    except ApiError as error:
        return Response(content=error.message, status_code=error.status, media_type=MediaType.TEXT)
    message = f"Uploaded the adapter {adapter.name} (rank {adapter.rank}); the tenant's keys can use it now."
    session_of(request).notices.append(message)
    return Response(content=message, status_code=201, media_type=MediaType.TEXT)


@post("/adapters/{adapter_id:uuid}/pin", opt=TENANT, include_in_schema=False)
async def pin_adapter(request: Request, adapter_id: AdapterId) -> Response:
    form = await request.form()
    pinned = form.get("pinned") == "true"
    adapter = await adapter_service(request).pin(admin_of(request), adapter_id, pinned)
    done = "Pinned" if pinned else "Unpinned"
    return see_other(f"/console/tenants/{adapter.tenant_id}/adapters", f"{done} the adapter {adapter.name}.", request)


@post("/adapters/{adapter_id:uuid}/unload", opt={ACCESS: Access.PLATFORM}, include_in_schema=False)
async def unload_adapter(request: Request, adapter_id: AdapterId) -> Response:
    adapter = await adapter_service(request).unload(admin_of(request), adapter_id)
    return see_other(
        f"/console/tenants/{adapter.tenant_id}/adapters",
        f"Unloaded the adapter {adapter.name}; its next request loads it again.",
        request,
    )


@get("/adapters/{adapter_id:uuid}/delete", opt=TENANT, include_in_schema=False)
async def confirm_delete_adapter(request: Request, adapter_id: AdapterId) -> Response:
    adapter = await adapter_service(request).get(adapter_id)
    return render(request, "adapter_delete.html", adapter=adapter, nav="tenants")


@post("/adapters/{adapter_id:uuid}/delete", opt=TENANT, include_in_schema=False)
async def delete_adapter(request: Request, adapter_id: AdapterId) -> Response:
    adapter = await adapter_service(request).delete(admin_of(request), adapter_id)
    return see_other(
        f"/console/tenants/{adapter.tenant_id}/adapters",
        f"Deleted the adapter {adapter.name}: new requests for it are refused.",
        request,
    )


ADAPTER_ROUTES = [adapters_page, upload_adapter, pin_adapter, unload_adapter, confirm_delete_adapter, delete_adapter]
