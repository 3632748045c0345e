"""Operations routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from prometheus_client import CONTENT_TYPE_LATEST

from app.web import gateway_of, json_response


class Health(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct):
    status: str
    checks: dict[str, bool]


READY = Example(summary="Ready", value={"status": "ready", "checks": {"model": True, "database": True}})
NOT_READY = Example(
    summary="Database down", value={"status": "not ready", "checks": {"model": True, "database": False}}
)


@get(
    "/health",
    summary="Liveness: the process answers",
    description="Always 200 while the process serves HTTP; says nothing about the model or the database.",
    tags=["operations"],
    responses={200: ResponseSpec(Health, examples=[Example(summary="Alive", value={"status": "ok"})])},
)
async def health() -> Health:
    return Health(status="ok")


@get(
    "/ready",
    summary="Readiness: the model is loaded and the database answers",
    description="200 when both checks pass, else 503 naming the check that failed; for load balancers.",
    tags=["operations"],
    responses={
        200: ResponseSpec(Readiness, examples=[READY]),
        503: ResponseSpec(Readiness, description="A check failed", examples=[NOT_READY]),
    },
)
async def ready(request: Request) -> Response:
    gateway = gateway_of(request)
    checks = {"model": gateway.engine.is_ready(), "database": await gateway.database.ping()}
    status = "ready" if all(checks.values()) else "not ready"
    return json_response(Readiness(status=status, checks=checks), 200 if status == "ready" else 503)


@get(
    "/metrics",
    summary="Prometheus metrics",
    description="Requests, tokens, TTFT and inter-token latency by tenant and adapter; queue depth, pool pages by "
    "owner kind and resident adapters from the engine.",
    tags=["operations"],
    media_type=MediaType.TEXT,
)
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    stats = await gateway.engine.stats() if gateway.engine.is_ready() else None
    return Response(content=gateway.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


OPS_ROUTES = [health, ready, metrics]
