"""The audit log page: every admin change, newest first, filtered by action, target and text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from litestar import Request, Response, get
from sqlalchemy import String, cast, or_, select

from app.admin.guards import ACCESS, Access
from app.console.forms import MAX_FIELD_CHARS
from app.console.pages import render
from app.db.tables import ApiKey, AuditLog, Tenant
from app.services import gateway_of

PAGE_ROWS = 200  # the newest rows matching the filters; narrow the filters to see older ones


@dataclass(frozen=True, slots=True)
class AuditEntry:
    at: datetime
    actor: str
    action: str
    target_type: str
    target_id: str | None
    before: str | None
    after: str | None


def _escape_like(text: str) -> str:
    """``text`` matched literally by ILIKE (its own % and _ are not wildcards)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _json(value: object) -> str | None:
    return None if value is None else json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


def _actor(row: AuditLog, key_name: str | None, prefix: str | None, tenant_name: str | None) -> str:
    """Who made the change: the key's name and prefix and its tenant's name, or this machine."""
    if row.actor_key_id is None:
        return "this machine"
    return f"{key_name or 'deleted key'} ({prefix or '?'}) of {tenant_name or 'an unknown tenant'}"


@get("/audit", opt={ACCESS: Access.PLATFORM}, include_in_schema=False)
async def audit_page(request: Request) -> Response:
    # PostgreSQL text cannot hold NUL: a filter with one matches nothing anyway.
    action = (request.query_params.get("action") or "")[:MAX_FIELD_CHARS].replace("\x00", "")
    text = (request.query_params.get("q") or "")[:MAX_FIELD_CHARS].replace("\x00", "")
    statement = (
        select(AuditLog, ApiKey.name, ApiKey.prefix, Tenant.name.label("tenant_name"))
        .outerjoin(ApiKey, ApiKey.id == AuditLog.actor_key_id)
        .outerjoin(Tenant, Tenant.id == AuditLog.actor_tenant_id)
        .order_by(AuditLog.at.desc(), AuditLog.id.desc())
        .limit(PAGE_ROWS)
    )
    if action:
        statement = statement.where(AuditLog.action == action)
    if text:
        pattern = "%" + _escape_like(text) + "%"
        statement = statement.where(
            or_(
                AuditLog.target_id.ilike(pattern),
                cast(AuditLog.before, String).ilike(pattern),
                cast(AuditLog.after, String).ilike(pattern),
            )
        )
    async with gateway_of(request).database.sessions() as session:
        actions = list(await session.scalars(select(AuditLog.action).distinct().order_by(AuditLog.action)))
        result = await session.execute(statement)
        entries = [
            AuditEntry(
                at=row.at,
                actor=_actor(row, name, prefix, tenant_name),
                action=row.action,
                target_type=row.target_type,
                target_id=row.target_id,
                before=_json(row.before),
                after=_json(row.after),
            )
            for row, name, prefix, tenant_name in result
        ]
    return render(
        request,
        "audit.html",
        entries=entries,
        actions=actions,
        action=action,
        text=text,
        page_rows=PAGE_ROWS,
        nav="audit",
    )


AUDIT_ROUTES = [audit_page]
