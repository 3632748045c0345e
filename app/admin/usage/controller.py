"""``GET /admin/usage``: the daily usage rollup per tenant and adapter, as JSON or as a CSV download."""

from __future__ import annotations

import uuid
from datetime import date
from typing import Annotated

import msgspec
from litestar import Request, Response, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.params import QueryParameter

from app.admin.guards import ACCESS, Access, caller_of
from app.admin.usage.service import (
    DEFAULT_DAYS,
    MAX_DAYS,
    UsageFormat,
    UsageQuery,
    UsageReport,
    UsageRow,
    usage_csv,
    usage_filename,
    usage_report,
)
from app.services import gateway_of
from app.web.responses import ERROR_RESPONSES, json_response

StartParam = Annotated[str | None, QueryParameter(description="First day (UTC), YYYY-MM-DD", format="date")]
EndParam = Annotated[str | None, QueryParameter(description="Last day (UTC), included; default: today", format="date")]
TenantParam = Annotated[str | None, QueryParameter(description="Only this tenant's usage", format="uuid")]
AdapterParam = Annotated[str | None, QueryParameter(description="Only this adapter's usage", format="uuid")]
FormatParam = Annotated[
    str | None, QueryParameter(name="format", description="json (default) or csv", enum=list(UsageFormat))
]

EXAMPLE_REPORT = UsageReport(
    data=[
        UsageRow(
            day=date(2026, 11, 2),
            tenant_id=uuid.UUID("5f0c6a52-0d0e-4f8e-9a57-0c1d2e3f4a5b"),
            tenant_name="acme",
            adapter_id=uuid.UUID("9b1e2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d"),
            adapter_name="support-bot",
            model="support-bot",
            requests=1200,
            prompt_tokens=96000,
            cached_prompt_tokens=40000,
            completion_tokens=51000,
            errors=3,
            cancelled=7,
        )
    ],
    start=date(2026, 11, 1),
    end=date(2026, 11, 30),
)


@get(
    "/usage",
    opt={ACCESS: Access.OWN_TENANT},
    summary="Usage per day, tenant and adapter",
    description=(
        "Rows of the `usage_daily` view (UTC days, both bounds included) with the names of their tenants and "
        f"adapters, ordered by day, tenant name and model. Without dates: the last {DEFAULT_DAYS} days up to today; "
        f"at most {MAX_DAYS} days per request. `format=csv` answers `text/csv` as a download, a header line of the "
        "same columns as the JSON rows, then one line per row. A `tenant-admin` key gets its own tenant's rows only "
        "(a `tenant_id` naming another tenant is a 404)."
    ),
    tags=["admin"],
    responses={
        200: ResponseSpec(
            data_container=UsageReport,
            generate_examples=False,
            description="The usage rows (JSON; `format=csv` gives the same rows as CSV)",
            examples=[Example(summary="One tenant's adapter on one day", value=msgspec.to_builtins(EXAMPLE_REPORT))],
        ),
        **{status: ERROR_RESPONSES[status] for status in (400, 401, 403, 404)},
    },
)
async def get_usage(
    request: Request,
    start: StartParam = None,
    end: EndParam = None,
    tenant_id: TenantParam = None,
    adapter_id: AdapterParam = None,
    output_format: FormatParam = None,
) -> Response:
    params = {"start": start, "end": end, "tenant_id": tenant_id, "adapter_id": adapter_id, "format": output_format}
    query = UsageQuery.parse(params).within(caller_of(request).tenant_scope)
    return _respond(await usage_report(gateway_of(request).database, query), query)


def _respond(report: UsageReport, query: UsageQuery) -> Response:
    if query.format is UsageFormat.JSON:
        return json_response(report)
    return Response(
        content=usage_csv(report),
        media_type="text/csv",  # Litestar adds "; charset=utf-8" to text types
        headers={"Content-Disposition": f'attachment; filename="{usage_filename(query)}"'},
    )


USAGE_ROUTES = [get_usage]
