"""The engine page: each worker's page pool (KV, prefix cache, adapters, CUDA graphs' scratch page where there is
one, free) and its running and waiting requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from litestar import Request, Response, get

from app.admin.guards import ACCESS, Access
from app.console.pages import render
from app.services import gateway_of
from engine import EngineStats

logger = logging.getLogger(__name__)

POOL_OWNERS = (("kv", "KV of running requests"), ("prefix_cache", "Prefix cache"), ("adapter", "Adapters"))
# Owners listed only where a worker has pages of theirs: the one page CUDA graphs' padding rows write (GPU only).
OPTIONAL_OWNERS = (("scratch", "Scratch (CUDA graphs)"),)


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker: str
    stats: EngineStats
    pool_rows: list[tuple[str, int, float]]  # (what, pages, percent of the pool)


def worker_view(worker: str, stats: EngineStats) -> WorkerView:
    total = max(stats.num_pages, 1)
    used = 0
    rows = []
    for owner, label in POOL_OWNERS + OPTIONAL_OWNERS:
        pages = stats.pages_by_owner.get(owner, 0)
        used += pages
        if pages or (owner, label) in POOL_OWNERS:
            rows.append((label, pages, 100.0 * pages / total))
    free = stats.pages_by_owner.get("free", stats.num_pages - used)
    rows.append(("Free", free, 100.0 * free / total))
    return WorkerView(worker, stats, rows)


@get("/engine", opt={ACCESS: Access.PLATFORM}, include_in_schema=False)
async def engine_page(request: Request) -> Response:
    engine = gateway_of(request).engine
    error = None
    workers: list[WorkerView] = []
    if not engine.is_ready():
        error = "The engine is not ready yet (it may still be loading the model); reload this page in a moment."
    else:
        try:
            workers = [worker_view(name, stats) for name, stats in sorted((await engine.worker_stats()).items())]
        except Exception as failure:  # a worker that does not answer is reported on the page, not as a 500
            logger.warning("console: engine stats unavailable: %s", failure)
            error = f"The engine did not report its state: {failure}. Check the server's log."
    return render(request, "engine.html", workers=workers, model=engine.model_name, error=error, nav="engine")


ENGINE_ROUTES = [engine_page]
