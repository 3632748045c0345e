"""``GET /admin/me``: which key is calling, of which tenant, and what it may administer."""

from __future__ import annotations

import uuid

import msgspec
from litestar import Request, get

from app.admin.guards import ACCESS, Access, caller_of
from app.web.responses import error_responses


class CallerOut(msgspec.Struct, kw_only=True):
    """The calling key; ``tenant_scope`` is the one tenant it manages, or null for a platform admin (all)."""

    key_id: uuid.UUID
    tenant_id: uuid.UUID
    tenant_name: str
    scopes: list[str]
    tenant_scope: uuid.UUID | None


@get(
    "/me",
    opt={ACCESS: Access.OWN_TENANT},
    summary="The calling key",
    description="The key this request carries: its id, its tenant, its valid scopes, and `tenant_scope`, the one "
    "tenant it manages (a `tenant-admin` key's own) or null for an `admin` key, which manages every tenant.",
    tags=["admin"],
    responses=error_responses(401, 403),
)
async def get_me(request: Request) -> CallerOut:
    caller = caller_of(request)
    principal = caller.principal
    return CallerOut(
        key_id=principal.key_id,
        tenant_id=principal.tenant_id,
        tenant_name=principal.tenant_name,
        scopes=sorted(principal.scopes),
        tenant_scope=caller.tenant_scope,
    )


ME_ROUTES = [get_me]
