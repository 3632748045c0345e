"""Operations routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST

from app.web import gateway_of, json_response


@get("/health", summary="Liveness: the process answers", tags=["operations"])
async def health() -> Response:
    return json_response({"status": "ok"})


@get("/ready", summary="Readiness: the model is loaded and the database answers", tags=["operations"])
async def ready(request: Request) -> Response:
    gateway = gateway_of(request)
    checks = {"model": gateway.engine.is_ready(), "database": await gateway.database.ping()}
    status = "ready" if all(checks.values()) else "not ready"
    return json_response({"status": status, "checks": checks}, 200 if status == "ready" else 503)


@get("/metrics", summary="Prometheus metrics", tags=["operations"])
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    stats = await gateway.engine.stats() if gateway.engine.is_ready() else None
    return Response(content=gateway.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


OPS_ROUTES = [health, ready, metrics]
