"""Console pages for a tenant's API keys: listing, creating (the secret shown once), rotating and revoking.

Each is Access.TENANT: a platform admin works on any tenant's keys, a tenant admin on its own tenant's. The
form offers the scopes the tenant's keys may hold (``scope_refusal``): `admin` in the `admin` tenant only,
`tenant-admin` in every other.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, time
from typing import Annotated, Any

from litestar import Request, Response, get, post
from litestar.datastructures import FormMultiDict
from litestar.params import PathParameter

from app.admin.adapters.controller import TenantId
from app.admin.guards import ACCESS, Access, admin_of
from app.admin.keys.controller import key_service
from app.admin.tenants.controller import tenant_service
from app.admin.tenants.schemas import KeyCreate, KeyRotate
from app.admin.tenants.service import LIMIT_FIELDS
from app.console.access import session_of
from app.console.forms import FormError, convert, form_values
from app.console.pages import render, see_other
from app.keys.service import Scope, scope_refusal
from app.web.errors import ApiError

SCOPES = (Scope.INFERENCE, Scope.ADMIN, Scope.TENANT_ADMIN)  # the order the form lists them in
SCOPE_LABELS = {
    Scope.INFERENCE: "inference (the OpenAI API)",
    Scope.ADMIN: "admin (the whole platform: this console and /admin, every tenant)",
    Scope.TENANT_ADMIN: "tenant-admin (this tenant's keys, adapters and usage, in this console and /admin)",
}
KeyId = Annotated[uuid.UUID, PathParameter(description="The key's id.")]


async def _keys_page(
    request: Request,
    tenant_id: TenantId,
    *,
    error: str | None = None,
    status_code: int = 200,
    form: Mapping[str, Any] | None = None,
) -> Response:
    tenant = await tenant_service(request).get(tenant_id)
    keys = (await key_service(request).list_keys(tenant_id)).data
    return render(
        request,
        "keys.html",
        status_code=status_code,
        tenant=tenant,
        keys=keys,
        scope_choices=scope_choices(tenant.name),
        now=datetime.now(UTC),
        error=error,
        form=form or {},
        nav="tenants",
    )


@get("/tenants/{tenant_id:uuid}/keys", opt={ACCESS: Access.TENANT}, include_in_schema=False)
async def keys_page(request: Request, tenant_id: TenantId) -> Response:
    return await _keys_page(request, tenant_id)


def scope_choices(tenant_name: str) -> list[tuple[str, str]]:
    """(scope, label) of each scope a key of this tenant may hold, as the form offers them."""
    return [(scope, SCOPE_LABELS[scope]) for scope in SCOPES if scope_refusal(scope, tenant_name) is None]


def _key_create(form: FormMultiDict) -> KeyCreate:
    values: dict[str, object] = dict(form_values(form, ("name", *LIMIT_FIELDS)))
    scopes = [scope for scope in form.getall("scopes", []) if isinstance(scope, str)]
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if unknown:
        raise FormError(f"Scopes: choose among {', '.join(SCOPES)}.")
    if not scopes:
        raise FormError("Scopes: tick at least one (inference calls the OpenAI API, the others administer).")
    values["scopes"] = scopes
    expires_on = form_values(form, ("expires_on",)).get("expires_on")
    if expires_on is not None:
        try:
            day = datetime.strptime(expires_on, "%Y-%m-%d").date()
        except ValueError:
            raise FormError(f"Expires on: expected a date as YYYY-MM-DD, got {expires_on!r}.") from None
        values["expires_at"] = datetime.combine(day, time(0, 0), tzinfo=UTC).isoformat()
    return convert(values, KeyCreate)


@post("/tenants/{tenant_id:uuid}/keys", opt={ACCESS: Access.TENANT}, include_in_schema=False)
async def create_key(request: Request, tenant_id: TenantId) -> Response:
    form = await request.form()
    try:
        created = await key_service(request).create(admin_of(request), tenant_id, _key_create(form))
    except (FormError, ApiError) as error:
        return await _keys_page(request, tenant_id, error=error.message, status_code=error.status, form=dict(form))
    session_of(request).new_secrets.append((f"New key {created.name} ({created.prefix})", created.key))
    return see_other(f"/console/tenants/{tenant_id}/keys")


@post("/keys/{key_id:uuid}/rotate", opt={ACCESS: Access.TENANT}, include_in_schema=False)
async def rotate_key(request: Request, key_id: KeyId) -> Response:
    """A successor key (its secret shown once); the old key works for the grace period chosen."""
    form = await request.form()
    tenant_id = _tenant_of_form(form)
    try:
        body = convert(form_values(form, ("grace_period_s",)), KeyRotate)
        created = await key_service(request).rotate(admin_of(request), key_id, body)
    except (FormError, ApiError) as error:
        if tenant_id is None:
            raise
        return await _keys_page(request, tenant_id, error=error.message, status_code=error.status)
    session_of(request).new_secrets.append((f"Rotated key {created.name}: the new key ({created.prefix})", created.key))
    return see_other(f"/console/tenants/{created.tenant_id}/keys")


@post("/keys/{key_id:uuid}/revoke", opt={ACCESS: Access.TENANT}, include_in_schema=False)
async def revoke_key(request: Request, key_id: KeyId) -> Response:
    revoked = await key_service(request).revoke(admin_of(request), key_id)
    return see_other(
        f"/console/tenants/{revoked.tenant_id}/keys",
        f"Revoked the key {revoked.name} ({revoked.prefix}): it is refused from now on.",
        request,
    )


def _tenant_of_form(form: FormMultiDict) -> uuid.UUID | None:
    """The tenant whose keys page sent the form, to show an error there."""
    try:
        return uuid.UUID(str(form.get("tenant_id")))
    except ValueError:
        return None


KEY_ROUTES = [keys_page, create_key, rotate_key, revoke_key]
