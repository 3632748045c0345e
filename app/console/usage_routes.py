"""The usage page (charts and a table per day and per tenant, key or adapter) and its CSV export."""

from __future__ import annotations

from litestar import Request, Response, get

from app.admin.tenants import tenant_service
from app.admin.usage_service import UsageQuery
from app.console.live_latency import ttft_lines
from app.console.pages import render
from app.console.usage_rows import UsageGroup, chart_series, usage_csv, usage_rows
from app.services import gateway_of
from app.web.errors import BadRequestError


def _query(request: Request) -> tuple[UsageQuery, UsageGroup]:
    """The page's filters, checked as GET /admin/usage checks them; BadRequestError naming the wrong one."""
    params = {name: request.query_params.get(name) or None for name in ("start", "end", "tenant_id")}
    query = UsageQuery.parse(params)
    group_name = request.query_params.get("group") or UsageGroup.TENANT
    try:
        group = UsageGroup(group_name)
    except ValueError:
        raise BadRequestError(f"Group by tenant, key or adapter, not {group_name!r}.") from None
    return query, group


@get("/usage", include_in_schema=False)
async def usage_page(request: Request) -> Response:
    tenants = (await tenant_service(request).list_tenants(include_deleted=True)).data
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
        live_latency=ttft_lines(gateway_of(request).metrics),
        nav="usage",
    )


@get("/usage.csv", include_in_schema=False)
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
