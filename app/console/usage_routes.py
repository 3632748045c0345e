"""The usage page (charts and a table per day and per tenant, key or adapter) and its CSV export.

Both are Access.OWN_TENANT: a tenant admin sees its own tenant's rows and latencies only.
"""

from __future__ import annotations

from litestar import Request, Response, get

from app.admin.guards import ACCESS, Access, caller_of
from app.admin.tenants.controller import tenant_service
from app.admin.tenants.schemas import TenantOut
from app.admin.usage.service import UsageQuery
from app.console.live_latency import LatencyLine, ttft_lines
from app.console.pages import render
from app.console.usage_rows import UsageGroup, chart_series, usage_csv, usage_rows
from app.services import gateway_of
from app.web.errors import BadRequestError


def _query(request: Request) -> tuple[UsageQuery, UsageGroup]:
    """The page's filters, checked as GET /admin/usage checks them; BadRequestError naming the wrong one."""
    params = {name: request.query_params.get(name) or None for name in ("start", "end", "tenant_id")}
    query = UsageQuery.parse(params).within(caller_of(request).tenant_scope)
    group_name = request.query_params.get("group") or UsageGroup.TENANT
    try:
        group = UsageGroup(group_name)
    except ValueError:
        raise BadRequestError(f"Group by tenant, key or adapter, not {group_name!r}.") from None
    return query, group


async def _tenants(request: Request) -> list[TenantOut]:
    """The tenants the filter offers: every one to a platform admin, its own to a tenant admin."""
    tenant_scope = caller_of(request).tenant_scope
    if tenant_scope is not None:
        return [await tenant_service(request).get(tenant_scope)]
    return (await tenant_service(request).list_tenants(include_deleted=True)).data


def _live_latency(request: Request, tenants: list[TenantOut]) -> list[LatencyLine]:
    """This gateway's time-to-first-token lines: all of them, or a tenant admin's own tenant's."""
    lines = ttft_lines(gateway_of(request).metrics)
    if caller_of(request).tenant_scope is None:
        return lines
    names = {tenant.name for tenant in tenants}  # the metrics label a line with its tenant's name
    return [line for line in lines if line.tenant in names]


@get("/usage", opt={ACCESS: Access.OWN_TENANT}, include_in_schema=False)
async def usage_page(request: Request) -> Response:
    tenants = await _tenants(request)
    try:
        query, group = _query(request)
    except BadRequestError as error:
        return render(request, "usage.html", status_code=400, error=error.message, tenants=tenants, nav="usage")
    rows = await usage_rows(gateway_of(request).database, query, group)
    csv_params = request.url.query or ""
    return render(
        request,
        "usage.html",
        error=None,
        tenants=tenants,
        query=query,
        group=group.value,
        rows=rows,
        chart=chart_series(rows, query.start, query.end),
        csv_href=f"/console/usage.csv?{csv_params}" if csv_params else "/console/usage.csv",
        live_latency=_live_latency(request, tenants),
        nav="usage",
    )


@get("/usage.csv", opt={ACCESS: Access.OWN_TENANT}, include_in_schema=False)
async def usage_csv_export(request: Request) -> Response:
    """Exactly the rows the page shows for the same filters, as a CSV download."""
    query, group = _query(request)
    rows = await usage_rows(gateway_of(request).database, query, group)
    filename = f"usage-by-{group.value}-{query.start}-{query.end}.csv"
    return Response(
        content=usage_csv(rows),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


USAGE_ROUTES = [usage_page, usage_csv_export]
