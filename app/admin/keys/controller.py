"""Admin routes for API keys (docs/admin.md); the logic is in app/admin/keys/service.py.

Each is Access.TENANT: a platform admin manages any tenant's keys, a tenant admin its own tenant's.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Request, delete, get, patch, post
from litestar.openapi.spec import Example
from litestar.params import Body, Parameter

from app.admin.guards import ACCESS, Access, admin_of
from app.admin.keys.service import KeyService
from app.admin.tenants.controller import TenantId
from app.admin.tenants.schemas import KeyCreate, KeyCreated, KeyList, KeyOut, KeyRotate, KeyUpdate
from app.services import gateway_of
from app.web.json_body import strict_json
from app.web.responses import error_responses

KeyId = Annotated[uuid.UUID, Parameter(description="The key's id (not its prefix), as listings show it.")]


def key_service(request: Request) -> KeyService:
    gateway = gateway_of(request)
    return KeyService(gateway.database, gateway.key_secret, gateway.authenticator)


@post(
    "/tenants/{tenant_id:uuid}/keys",
    opt={ACCESS: Access.TENANT},
    summary="Create an API key",
    description="Issues a key for the tenant. The response's `key` is the plaintext, shown this once and stored "
    "nowhere: hand it over now. Scopes: `inference` (the OpenAI API, the default), `admin` (this API for every "
    "tenant; keys of the `admin` tenant only) and `tenant-admin` (this API for its own tenant's keys, adapters and "
    "usage; keys of any other tenant). A scope the tenant's keys cannot hold is a 400 saying why. "
    "Limits set on the key narrow the tenant's for this key; the tenant's still hold across all its keys.",
    tags=["admin"],
    before_request=strict_json(KeyCreate),
    responses=error_responses(400, 401, 403, 404, 409, 413),
)
async def create_key(
    request: Request,
    tenant_id: TenantId,
    data: Annotated[
        KeyCreate,
        Body(
            title="New API key",
            examples=[
                Example(summary="Inference key", value={"name": "backend"}),
                Example(
                    summary="Expiring key",
                    value={"name": "ci", "scopes": ["inference"], "expires_at": "2030-01-01T00:00:00Z"},
                ),
                Example(
                    summary="Key with its own limits", value={"name": "batch", "rpm_limit": 30, "tpm_limit": 20000}
                ),
            ],
        ),
    ],
) -> KeyCreated:
    return await key_service(request).create(admin_of(request), tenant_id, data)


@get(
    "/tenants/{tenant_id:uuid}/keys",
    opt={ACCESS: Access.TENANT},
    summary="List a tenant's API keys",
    description="The tenant's keys, revoked ones included, oldest first: prefixes only, never a secret.",
    tags=["admin"],
    responses=error_responses(401, 403, 404),
)
async def list_keys(request: Request, tenant_id: TenantId) -> KeyList:
    return await key_service(request).list_keys(tenant_id)


@patch(
    "/keys/{key_id:uuid}",
    opt={ACCESS: Access.TENANT},
    summary="Change an API key's limits",
    description="Changes the limits given and keeps the others; a limit set to null leaves only the tenant's. "
    "Changes hold within a second. A revoked key cannot be changed (409).",
    tags=["admin"],
    before_request=strict_json(KeyUpdate),
    responses=error_responses(400, 401, 403, 404, 409, 413),
)
async def update_key(
    request: Request,
    key_id: KeyId,
    data: Annotated[
        KeyUpdate,
        Body(
            title="Key limit changes",
            examples=[
                Example(summary="Narrow", value={"rpm_limit": 10, "max_concurrent": 2}),
                Example(summary="Only the tenant's limits", value={"rpm_limit": None, "tpm_limit": None}),
            ],
        ),
    ],
) -> KeyOut:
    return await key_service(request).update(admin_of(request), key_id, data)


@delete(
    "/keys/{key_id:uuid}",
    opt={ACCESS: Access.TENANT},
    status_code=200,
    summary="Revoke an API key",
    description="The key is refused within a second. Revoking a revoked key changes nothing.",
    tags=["admin"],
    responses=error_responses(401, 403, 404),
)
async def revoke_key(request: Request, key_id: KeyId) -> KeyOut:
    return await key_service(request).revoke(admin_of(request), key_id)


@post(
    "/keys/{key_id:uuid}/rotate",
    opt={ACCESS: Access.TENANT},
    summary="Rotate an API key",
    description="Issues a new key with the same tenant, name and scopes (plaintext in `key`, shown once). The old key "
    "keeps working for `grace_period_s` seconds (default 3600, at most 30 days), or until its own earlier expiry. "
    "A revoked key cannot be rotated (409).",
    tags=["admin"],
    before_request=strict_json(KeyRotate),
    responses=error_responses(400, 401, 403, 404, 409, 413),
)
async def rotate_key(
    request: Request,
    key_id: KeyId,
    data: Annotated[
        KeyRotate,
        Body(
            title="Rotation",
            examples=[
                Example(summary="One hour of overlap", value={"grace_period_s": 3600}),
                Example(summary="Stop the old key now", value={"grace_period_s": 0}),
            ],
        ),
    ],
) -> KeyCreated:
    return await key_service(request).rotate(admin_of(request), key_id, data)


KEY_ROUTES = [create_key, list_keys, update_key, revoke_key, rotate_key]
