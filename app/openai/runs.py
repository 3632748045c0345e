"""One request's run through the engine, metered: exactly one usage record, whatever happens.

:func:`metered_outputs` wraps the engine's output stream. Its ``finally`` writes the usage record
when the request finishes, fails, or its client goes away (``cancelled``, counting what was
generated), feeds the Prometheus counters and latency histograms, and settles the run's admission
(its token reservation becomes the tokens used, its concurrency slots are freed). A request the engine
failed on (its other requests went on) surfaces as an InternalError, OpenAI's 500, naming the request id;
one the engine ended because the server is stopping, as a 503 that says to retry (billed as cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

from app.adapters.resolver import ResolvedModel
from app.engine_client import EngineClient
from app.errors import InternalError, ServiceUnavailableError
from app.keys.authenticator import Principal
from app.latency_histogram import HistogramSeries
from app.limits.limiter import Admission
from app.metrics import BASE_ADAPTER_LABEL, GatewayMetrics
from app.usage.records import UsageRecord
from app.usage.writer import UsageWriter
from engine import RequestFailedError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

ENDED_BY_SERVER = "abort"  # the engine's finish reason for requests it ended itself (it is stopping)


@dataclass(frozen=True, slots=True)
class Run:
    """Everything about one request the engine and the meter need."""

    request_id: str
    endpoint: str
    principal: Principal
    model: ResolvedModel
    prompt_ids: list[int]
    params: SamplingParams
    admission: Admission


@dataclass(slots=True)
class Meter:
    """What the gateway saw of a run so far."""

    last: RequestOutput | None = None
    first_token_at: float | None = None
    last_output_at: float | None = None


async def metered_outputs(
    run: Run, engine: EngineClient, writer: UsageWriter, metrics: GatewayMetrics
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for ``run``; records its usage once when the stream ends, however it ends."""
    started_at = datetime.now(UTC)
    start = time.perf_counter()
    meter = Meter()
    status = "error"
    labels = (run.principal.tenant_name, run.model.name if run.model.adapter_id else BASE_ADAPTER_LABEL)
    ttft, inter_token = metrics.ttft.labels(*labels), metrics.inter_token.labels(*labels)  # looked up once a run
    try:
        outputs = engine.generate(
            run.prompt_ids,
            run.params,
            run.request_id,
            run.model.engine_adapter,
            tenant=str(run.principal.tenant_id),
            weight=run.principal.fair_share_weight,
        )
        async with contextlib.aclosing(outputs):  # leaving early aborts the sequence at once
            async for output in outputs:
                _observe_latency(meter, output, ttft, inter_token, start)
                meter.last = output
                yield output
        if meter.last is not None and meter.last.finish_reason == ENDED_BY_SERVER:
            status = "cancelled"
            raise ServiceUnavailableError(
                f"The server is shutting down, so this response was cut short after {len(meter.last.token_ids)} "
                "tokens; retry the request."
            )
        status = "ok"
    except RequestFailedError:  # the engine logged what went wrong; the client gets no internals
        raise InternalError(
            f"The server failed while generating this response (request id {run.request_id}); the failure was "
            "logged and no other request was affected. Retry; if it fails again, report the request id."
        ) from None
    except (GeneratorExit, asyncio.CancelledError):
        status = "cancelled"  # the client went away; leaving engine.generate aborted the sequence
        raise
    finally:
        try:
            _record(run, meter, status, started_at, start, writer, metrics, labels)
        finally:
            num_completion = 0 if meter.last is None else len(meter.last.token_ids)
            run.admission.settle(len(run.prompt_ids) + num_completion)  # the same count as the usage row's


def _observe_latency(
    meter: Meter, output: RequestOutput, ttft: HistogramSeries, inter_token: HistogramSeries, start: float
) -> None:
    if not output.delta_token_ids:
        return
    now = time.perf_counter()
    if meter.first_token_at is None:
        meter.first_token_at = now
        ttft.observe(now - start)
    elif meter.last_output_at is not None:
        inter_token.observe(now - meter.last_output_at)
    meter.last_output_at = now


def _record(
    run: Run,
    meter: Meter,
    status: str,
    started_at: datetime,
    start: float,
    writer: UsageWriter,
    metrics: GatewayMetrics,
    labels: tuple[str, str],
) -> None:
    last = meter.last
    if status == "ok" and last is not None and last.finish_reason == "abort":
        status = "cancelled"
    completion_tokens = 0 if last is None else len(last.token_ids)
    ttft_ms = None if meter.first_token_at is None else (meter.first_token_at - start) * 1000.0
    writer.record(
        UsageRecord(
            request_id=run.request_id,
            tenant_id=run.principal.tenant_id,
            api_key_id=run.principal.key_id,
            adapter_id=run.model.adapter_id,
            model=run.model.name,
            prompt_tokens=len(run.prompt_ids),
            cached_prompt_tokens=0 if last is None else last.num_cached_tokens,
            completion_tokens=completion_tokens,
            status=status,
            finish_reason=None if last is None else last.finish_reason,
            started_at=started_at,
            finished_at=datetime.now(UTC),
            ttft_ms=ttft_ms,
        )
    )
    metrics.requests.labels(*labels, run.endpoint, status).inc()
    metrics.prompt_tokens.labels(*labels).inc(len(run.prompt_ids))
    metrics.completion_tokens.labels(*labels).inc(completion_tokens)
    logger.info(
        "request %s %s: %s, %d prompt + %d completion tokens, %s",
        run.request_id,
        run.endpoint,
        status,
        len(run.prompt_ids),
        completion_tokens,
        "no token" if ttft_ms is None else f"ttft {ttft_ms:.0f} ms",
    )
