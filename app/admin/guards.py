"""The admin guard: every /admin handler starts with ``await require_admin(request)``."""

from __future__ import annotations

from litestar import Request

from app.keys.authenticator import Principal
from app.keys.service import Scope
from app.services import gateway_of


async def require_admin(request: Request) -> Principal:
    """The caller if its key has the `admin` scope; 401 for a bad key, 403 for a key without the scope."""
    return await gateway_of(request).authenticator.authenticate(request.headers.get("authorization"), Scope.ADMIN)
