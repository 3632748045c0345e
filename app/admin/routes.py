"""The admin router: every /admin route, each behind ``admin_guard`` and its own declared access rule."""

from litestar import Router
from litestar.handlers import BaseRouteHandler

from app.admin.adapters.controller import ADAPTER_ROUTES
from app.admin.guards import admin_guard, declared_access
from app.admin.keys.controller import KEY_ROUTES
from app.admin.me import ME_ROUTES
from app.admin.tenants.controller import TENANT_ROUTES
from app.admin.usage.controller import USAGE_ROUTES

ADMIN_PATH = "/admin"
ADMIN_ROUTES: list[BaseRouteHandler] = [*TENANT_ROUTES, *KEY_ROUTES, *ADAPTER_ROUTES, *USAGE_ROUTES, *ME_ROUTES]


def admin_router() -> Router:
    """Every admin route under /admin behind ``admin_guard``; UndeclaredAccessError if one declares no rule."""
    for handler in ADMIN_ROUTES:
        declared_access(handler)
    return Router(path=ADMIN_PATH, route_handlers=ADMIN_ROUTES, guards=[admin_guard])
