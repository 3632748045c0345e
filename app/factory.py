"""``create_app()``: the Litestar application with every route, error handler and the lifespan."""

from __future__ import annotations

import asyncio
from pathlib import Path

from litestar import Litestar
from litestar.exceptions import HTTPException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig

from app.admin.routes import admin_router
from app.api_docs.schema import complete_openapi_schema
from app.console.router import console_router, console_static_router, console_templates
from app.console.sessions import ConsoleSessions
from app.engine_clients.interface import EngineClient
from app.gateway import gateway_lifespan
from app.observability.routes import OPS_ROUTES
from app.openai.chat.controller import CHAT_ROUTES
from app.openai.responses.controller import RESPONSES_ROUTES
from app.settings import Settings
from app.web.errors import ApiError
from app.web.request_context import RequestIdMiddleware
from app.web.request_size import request_too_large_handler
from app.web.responses import api_error_handler, http_error_handler, internal_error_handler


def create_app(
    settings: Settings | None = None,
    *,
    engine: EngineClient | None = None,
    demo_adapters: dict[str, Path] | None = None,
) -> Litestar:
    """The app; it starts the database, the engine (unless one is given) and the writers when it starts."""
    settings = settings or Settings.from_env()
    console_routes = [console_router(), console_static_router()] if settings.console else []
    app = Litestar(
        route_handlers=[*CHAT_ROUTES, *RESPONSES_ROUTES, *OPS_ROUTES, admin_router(), *console_routes],
        template_config=console_templates() if settings.console else None,
        lifespan=[gateway_lifespan(settings, engine, demo_adapters)],
        middleware=[DefineMiddleware(RequestIdMiddleware)],
        request_max_body_size=settings.max_request_bytes,  # the adapter upload sets its own, counted as bytes arrive
        exception_handlers={
            ApiError: api_error_handler,
            RequestEntityTooLarge: request_too_large_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        openapi_config=OpenAPIConfig(title="loraplex", version="0.1.0"),
        logging_config=None,
    )
    app.state.console_sessions = ConsoleSessions()
    app.state.stopping = asyncio.Event()  # set by the server when a stop comes before the gateway has started
    complete_openapi_schema(app.openapi_schema)
    return app
