"""One HTTP request's run through the engine, metered: exactly one usage record, whatever happens.

A run is one engine request per prompt (a completions request may send several), each with the
request's ``n`` choices. :func:`metered_outputs` yields ``(choice index, output)`` for all of them, the
index counted as OpenAI does (prompt-major, then ``n``). One engine request is read directly; several
are merged as they arrive (app/openai/chat/fan_in.py).

Its ``finally`` writes the usage record when the run finishes, fails, or its client goes away (``cancelled``,
counting what was generated): every prompt's tokens once, every choice's completion tokens; a reply completes
only once its record is durable (app/usage/spool.py). It feeds the Prometheus counters and latency histograms,
and settles the run's admission (its token reservation becomes the tokens used, its concurrency slots are
freed). A request the engine failed on (its other requests went on) surfaces as an InternalError, OpenAI's
500, naming the request id; one the engine ended because the server is stopping, as a 503 that says to retry
(billed as cancelled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from app.adapters.resolver import ResolvedModel
from app.engine_clients.interface import EngineClient
from app.keys.authenticator import Principal
from app.limits.limiter import Admission
from app.observability.latency_histogram import HistogramSeries
from app.observability.metrics import BASE_ADAPTER_LABEL, GatewayMetrics
from app.openai.chat.fan_in import fan_in
from app.usage.records import UsageRecord
from app.usage.writer import UsageWriter, wait_durable
from app.web.errors import InternalError, ServiceUnavailableError
from engine import RequestFailedError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

ENDED_BY_SERVER = "abort"  # the engine's finish reason for requests it ended itself (it is stopping)
# The usage row has one finish reason for all choices: the first of these any choice ended with, else choice 0's.
FINISH_PRECEDENCE = ("error", "abort", "length")


@dataclass(frozen=True, slots=True)
class Submission:
    """One engine request of a run: a prompt and how to sample its choices."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Run:
    """Everything about one HTTP request the engine and the meter need."""

    request_id: str
    endpoint: str
    principal: Principal
    model: ResolvedModel
    submissions: tuple[Submission, ...]
    admission: Admission

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(submission.prompt_ids) for submission in self.submissions)


@dataclass(slots=True)
class Meter:
    """What the gateway saw of a run so far: each choice's last output."""

    last: dict[int, RequestOutput] = field(default_factory=dict)
    first_token_at: float | None = None
    last_output_at: float | None = None

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.last.values())

    def finish_reason(self) -> str | None:
        reasons = [output.finish_reason for _, output in sorted(self.last.items())]
        for reason in FINISH_PRECEDENCE:
            if reason in reasons:
                return reason
        return reasons[0] if reasons else None


def num_cached_prompt_tokens(last: dict[int, RequestOutput], n: int) -> int:
    """Prompt tokens served from the prefix cache, each prompt once: its first choice's (its choices share it)."""
    return sum(output.num_cached_tokens for index, output in last.items() if index % n == 0)


async def metered_outputs(
    run: Run, engine: EngineClient, writer: UsageWriter, metrics: GatewayMetrics
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(choice index, output)`` for every choice of ``run``; records its usage once when the stream ends."""
    started_at = datetime.now(UTC)
    start = time.perf_counter()
    meter = Meter()
    status = "error"
    labels = (run.principal.tenant_name, run.model.name if run.model.adapter_id else BASE_ADAPTER_LABEL)
    ttft, inter_token = metrics.ttft.labels(*labels), metrics.inter_token.labels(*labels)  # looked up once a run
    try:
        async with contextlib.aclosing(_choices(run, engine)) as outputs:  # leaving early aborts every sequence
            async for index, output in outputs:
                _observe_latency(meter, output, ttft, inter_token, start)
                meter.last[index] = output
                yield index, output
        if any(output.finish_reason == ENDED_BY_SERVER for output in meter.last.values()):
            status = "cancelled"
            raise ServiceUnavailableError(
                f"The server is shutting down, so this response was cut short after {meter.num_completion_tokens} "
                "tokens; retry the request."
            )
        status = "ok"
    except RequestFailedError:  # the engine logged what went wrong; the client gets no internals
        raise InternalError(
            f"The server failed while generating this response (request id {run.request_id}); the failure was "
            "logged and no other request was affected. Retry; if it fails again, report the request id."
        ) from None
    except (GeneratorExit, asyncio.CancelledError):
        status = "cancelled"  # the client went away; leaving engine.generate aborted the sequences
        raise
    finally:
        try:
            durable = _record(run, meter, status, started_at, start, writer, metrics, labels)
        finally:
            run.admission.settle(run.num_prompt_tokens + meter.num_completion_tokens)  # the usage row's count
        if status != "cancelled":  # the reply completes once its usage is on disk; a client gone waits for nothing
            await wait_durable(durable)


async def _choices(run: Run, engine: EngineClient) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Each output with its choice's index: read directly for one prompt, merged for several."""
    tenant, weight = str(run.principal.tenant_id), run.principal.fair_share_weight
    streams = [
        engine.generate(s.prompt_ids, s.params, s.request_id, run.model.engine_adapter, tenant=tenant, weight=weight)
        for s in run.submissions
    ]
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):  # type: ignore[type-var]  # engine streams are async generators
            async for output in streams[0]:
                yield output.index, output
        return
    n = run.submissions[0].params.n
    async with contextlib.aclosing(fan_in(streams)) as merged:
        async for prompt_i, output in merged:
            yield prompt_i * n + output.index, output


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
) -> concurrent.futures.Future[None]:
    finish_reason = meter.finish_reason()
    if status == "ok" and finish_reason == ENDED_BY_SERVER:
        status = "cancelled"
    num_prompt, num_completion = run.num_prompt_tokens, meter.num_completion_tokens
    ttft_ms = None if meter.first_token_at is None else (meter.first_token_at - start) * 1000.0
    durable = writer.record(
        UsageRecord(
            request_id=run.request_id,
            tenant_id=run.principal.tenant_id,
            api_key_id=run.principal.key_id,
            adapter_id=run.model.adapter_id,
            model=run.model.name,
            prompt_tokens=num_prompt,
            cached_prompt_tokens=num_cached_prompt_tokens(meter.last, run.submissions[0].params.n),
            completion_tokens=num_completion,
            status=status,
            finish_reason=finish_reason,
            started_at=started_at,
            finished_at=datetime.now(UTC),
            ttft_ms=ttft_ms,
        )
    )
    metrics.requests.labels(*labels, run.endpoint, status).inc()
    metrics.prompt_tokens.labels(*labels).inc(num_prompt)
    metrics.completion_tokens.labels(*labels).inc(num_completion)
    logger.info(
        "request %s %s: %s, %d prompt + %d completion tokens, %s",
        run.request_id,
        run.endpoint,
        status,
        num_prompt,
        num_completion,
        "no token" if ttft_ms is None else f"ttft {ttft_ms:.0f} ms",
    )
    return durable
