"""Who may call an admin route: one rule per route, declared in its ``opt``, checked by one guard.

Two kinds of key administer (docs/admin.md#scopes): an ``admin`` key (valid only in the `admin` tenant)
runs the platform, every tenant included; a ``tenant-admin`` key manages its own tenant's keys, adapters
and usage. Every route declares ``opt={ACCESS: Access.…}``:

- ``Access.PLATFORM``: admin keys only; a tenant admin gets 403.
- ``Access.TENANT``: admin keys, and tenant-admin keys of the tenant that owns what the path names (its
  ``tenant_id``, ``key_id`` or ``adapter_id``). To a tenant admin another tenant's record is a 404 worded
  as for an id that does not exist, so an answer never tells whether it exists.
- ``Access.OWN_TENANT``: admin keys, and tenant-admin keys whose answers the handler narrows to their own
  tenant (``caller_of(request).tenant_scope``); a ``tenant_id`` query parameter naming another tenant is a 404.

``admin_guard`` sits on the admin router (app/admin/routes.py), which refuses to be built with a route that
declares nothing, and the console's guard applies the same rules (``check_access``) to its pages. The key is
checked before the body is read, so a caller without the right key learns nothing about the body.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.enums import HttpMethod
from litestar.handlers import BaseRouteHandler
from sqlalchemy import select

from app.db.tables import Adapter, ApiKey
from app.keys.authenticator import Principal
from app.keys.service import Scope
from app.services import gateway_of
from app.web.errors import NotFoundError, PermissionDeniedError

logger = logging.getLogger(__name__)

ACCESS = "admin_access"  # the opt key every admin route (and console page) sets
CALLER_STATE = "admin_caller"  # where admin_guard leaves the caller, in the request's state
ADMIN_SCOPES = (Scope.ADMIN, Scope.TENANT_ADMIN)
PATH_PARAMETER = re.compile(r"\{(\w+)(?::\w+)?\}")


class Access(StrEnum):
    """What a route needs from the caller's key; the module docstring says what each admits."""

    PLATFORM = "platform"
    TENANT = "tenant"
    OWN_TENANT = "own-tenant"


# What a TENANT route's path may name: (its name in messages, its table, whose rows have a tenant_id).
# `tenant_id` names the tenant itself.
OWNED_RECORDS: dict[str, tuple[str, type[ApiKey] | type[Adapter] | None]] = {
    "tenant_id": ("tenant", None),
    "key_id": ("API key", ApiKey),
    "adapter_id": ("adapter", Adapter),
}


@dataclass(frozen=True, slots=True)
class AdminCaller:
    """A caller the guard let through: its key, and whether that key runs the platform or one tenant."""

    principal: Principal

    @property
    def is_platform_admin(self) -> bool:
        return Scope.ADMIN in self.principal.scopes

    @property
    def tenant_scope(self) -> uuid.UUID | None:
        """The one tenant this caller may see (a tenant admin's own), or None: every tenant (a platform admin)."""
        return None if self.is_platform_admin else self.principal.tenant_id


class UndeclaredAccessError(TypeError):
    """An admin route or console page without a valid ``opt={ACCESS: ...}``: refused to be served at all."""


def declared_access(handler: BaseRouteHandler) -> Access:
    """The rule ``handler`` declares; UndeclaredAccessError when it declares none, or TENANT without an owner."""
    try:
        access = Access(handler.opt.get(ACCESS))
    except ValueError:
        raise UndeclaredAccessError(
            f"The route {handler.handler_name} ({', '.join(sorted(handler.paths))}) declares no admin access rule; "
            f"give it opt={{ACCESS: Access.PLATFORM | Access.TENANT | Access.OWN_TENANT}} (app/admin/guards.py)."
        ) from None
    if access is Access.TENANT and not all(owner_parameter(path) for path in handler.paths):
        raise UndeclaredAccessError(
            f"The route {handler.handler_name} declares Access.TENANT but its path names none of "
            f"{', '.join(OWNED_RECORDS)}, so its tenant is unknown; declare Access.PLATFORM or Access.OWN_TENANT."
        )
    return access


def lists_methods_only(handler: BaseRouteHandler) -> bool:
    """Litestar's own OPTIONS handler of a path, which answers its allowed methods and nothing else.

    It declares no rule (Litestar makes it, not a route module) and is served to anyone, as the OpenAPI
    schema is; a route module's own handlers are all checked by ``declared_access`` when the router is built.
    """
    methods = getattr(handler, "http_methods", set())
    return methods == {HttpMethod.OPTIONS} and ACCESS not in handler.opt


def owner_parameter(path: str) -> str | None:
    """The path parameter naming the tenant's record in ``path``, if it has one."""
    return next((name for name in PATH_PARAMETER.findall(path) if name in OWNED_RECORDS), None)


async def authenticate_admin(connection: ASGIConnection, authorization: str | None) -> AdminCaller:
    """The caller if its key has the `admin` or `tenant-admin` scope (401 for a bad key, 403 otherwise)."""
    principal = await gateway_of(connection).authenticator.authenticate(authorization, *ADMIN_SCOPES)  # type: ignore[arg-type]
    return AdminCaller(principal)


async def check_access(connection: ASGIConnection, handler: BaseRouteHandler, caller: AdminCaller) -> None:
    """Raise unless ``caller`` may call ``handler`` on what the request names (the module docstring's rules)."""
    access = declared_access(handler)
    if caller.is_platform_admin:
        return
    principal = caller.principal
    if access is Access.PLATFORM:
        raise PermissionDeniedError(
            f"This needs an `{Scope.ADMIN}` key of the platform; a `{Scope.TENANT_ADMIN}` key manages only its "
            f"own tenant's ({principal.tenant_name}) API keys, adapters and usage."
        )
    if access is Access.OWN_TENANT:
        named = _uuid_or_none(connection.query_params.get("tenant_id"))
        if named is not None and named != principal.tenant_id:
            raise _not_yours("tenant", named, principal)
        return
    parameter = next(owner_parameter(path) for path in handler.paths)
    assert parameter is not None  # declared_access checked it
    record_id = connection.path_params[parameter]
    if await _owner_of(connection, parameter, record_id) != principal.tenant_id:
        raise _not_yours(OWNED_RECORDS[parameter][0], record_id, principal)


async def admin_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Litestar guard of the admin router: the key, then the route's rule; the caller is kept for the handler."""
    if lists_methods_only(handler):
        return
    caller = await authenticate_admin(connection, connection.headers.get("authorization"))
    await check_access(connection, handler, caller)
    connection.state[CALLER_STATE] = caller


def caller_of(request: Request) -> AdminCaller:
    """The caller that ``admin_guard`` let through."""
    return request.state[CALLER_STATE]


def admin_of(request: Request) -> Principal:
    """The key of the caller ``admin_guard`` let through: the actor its audit rows name."""
    return caller_of(request).principal


async def _owner_of(connection: ASGIConnection, parameter: str, record_id: uuid.UUID) -> uuid.UUID | None:
    table = OWNED_RECORDS[parameter][1]
    if table is None:
        return record_id
    async with gateway_of(connection).database.sessions() as session:  # type: ignore[arg-type]
        return await session.scalar(select(table.tenant_id).where(table.id == record_id))


def _not_yours(what: str, record_id: uuid.UUID, principal: Principal) -> NotFoundError:
    """The 404 a tenant admin gets for another tenant's record: the words of one that does not exist."""
    return NotFoundError(
        f"No {what} of the tenant `{principal.tenant_name}` has the id {record_id}; a `{Scope.TENANT_ADMIN}` key "
        "sees only its own tenant's records."
    )


def _uuid_or_none(text: str | None) -> uuid.UUID | None:
    try:
        return None if text is None else uuid.UUID(text)
    except ValueError:
        return None  # the handler refuses it with a 400 naming the parameter
