"""The console's Router: its pages under /console behind the session guard, its static files, its templates."""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.datastructures import CacheControlHeader, ResponseHeader
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from app.admin.guards import declared_access
from app.console.access import PUBLIC, console_guard
from app.console.adapter_routes import ADAPTER_ROUTES
from app.console.audit_routes import AUDIT_ROUTES
from app.console.auth_routes import AUTH_ROUTES
from app.console.engine_routes import ENGINE_ROUTES
from app.console.filters import add_filters
from app.console.key_routes import KEY_ROUTES
from app.console.pages import CONSOLE_EXCEPTION_HANDLERS
from app.console.tenant_routes import TENANT_ROUTES
from app.console.usage_routes import USAGE_ROUTES

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"
CONSOLE_PATH = "/console"
STATIC_MAX_AGE_S = 3600  # the files change only with a new release of the package

# Scripts and styles only from the gateway itself: an injected <script> or inline handler would not run.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    ResponseHeader(name="Content-Security-Policy", value=CONTENT_SECURITY_POLICY),
    ResponseHeader(name="X-Content-Type-Options", value="nosniff"),
    ResponseHeader(name="Referrer-Policy", value="no-referrer"),
    ResponseHeader(name="X-Frame-Options", value="DENY"),
    ResponseHeader(name="Cache-Control", value="no-store"),  # pages show keys' secrets once and tenants' data
]


CONSOLE_ROUTES = [
    *AUTH_ROUTES,
    *TENANT_ROUTES,
    *KEY_ROUTES,
    *ADAPTER_ROUTES,
    *USAGE_ROUTES,
    *AUDIT_ROUTES,
    *ENGINE_ROUTES,
]


def console_router() -> Router:
    """Every console page, each behind ``console_guard`` (the sign-in page is the one marked public).

    Each other page declares its access rule as the admin routes do; UndeclaredAccessError if one does not.
    """
    for handler in CONSOLE_ROUTES:
        if not handler.opt.get(PUBLIC):
            declared_access(handler)
    return Router(
        path=CONSOLE_PATH,
        route_handlers=CONSOLE_ROUTES,
        guards=[console_guard],
        exception_handlers=CONSOLE_EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        response_headers=SECURITY_HEADERS,
        include_in_schema=False,
    )


def console_static_router() -> Router:
    """The vendored htmx and uPlot, the stylesheet and the console's script; public, like any static file."""
    return create_static_files_router(
        path=f"{CONSOLE_PATH}/static",
        directories=[STATIC_DIR],
        name="console-static",
        cache_control=CacheControlHeader(max_age=STATIC_MAX_AGE_S),
        include_in_schema=False,
    )


def console_templates() -> TemplateConfig:
    """Jinja over the console's templates; Litestar's Jinja environment escapes every value (autoescape on)."""
    return TemplateConfig(directory=TEMPLATE_DIR, engine=JinjaTemplateEngine, engine_callback=add_filters)
