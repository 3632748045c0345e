"""Operations routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from prometheus_client import CONTENT_TYPE_LATEST

from app.services import gateway_of
from app.web.responses import json_response


class Health(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct):
    status: str
    checks: dict[str, bool]


READY = Example(summary="Ready", value={"status": "ready", "checks": {"model": True, "database": True}})
DEGRADED = Example(
    summary="Database down: serving cached keys, usage buffered",
    value={"status": "degraded", "checks": {"model": True, "database": False}},
)
NOT_READY = Example(
    summary="Model not loaded", value={"status": "not ready", "checks": {"model": False, "database": True}}
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
    description="For load balancers and alerts. 200 `ready` when both checks pass; 200 `degraded` when the model "
    "serves but the database does not answer (keys and adapters used within the last hour keep working, usage "
    "rows wait in memory and are written when it is back; alert on it, but keep routing traffic here); 503 "
    "`not ready` when the model cannot serve.",
    tags=["operations"],
    responses={
        200: ResponseSpec(Readiness, examples=[READY, DEGRADED]),
        503: ResponseSpec(Readiness, description="The model cannot serve", examples=[NOT_READY]),
    },
)
async def ready(request: Request) -> Response:
    gateway = gateway_of(request)
    checks = {"model": gateway.engine.is_ready(), "database": await gateway.database.ping()}
    if not checks["model"]:
        return json_response(Readiness(status="not ready", checks=checks), 503)
    return json_response(Readiness(status="ready" if checks["database"] else "degraded", checks=checks), 200)


@get(
    "/metrics",
    summary="Prometheus metrics",
    description="Requests, tokens, TTFT and inter-token latency by tenant and adapter; queue depth, pool pages by "
    "owner kind and resident adapters from each engine worker (label `worker`), and the vLLM gauges a Kubernetes "
    "router reads for LoRA-affine routing (`vllm:num_requests_waiting`, `vllm:num_requests_running`, "
    "`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`).",
    tags=["operations"],
    media_type=MediaType.TEXT,
)
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    stats_by_worker = await gateway.engine.worker_stats() if gateway.engine.is_ready() else None
    content = gateway.metrics.render(stats_by_worker, gateway.writer.num_pending, gateway.writer.spool_bytes)
    return Response(content=content, media_type=CONTENT_TYPE_LATEST)


OPS_ROUTES = [health, ready, metrics]
