"""The running gateway's services: the record every handler reaches through ``app.state.gateway``.

app/gateway.py builds it, starts what runs in the background and stops it all; handlers only read it. This
module holds the record and nothing that builds or serves it, so handlers depend on the services they use
and not on the composition root.
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar import Request

from app.adapters.announcements import AdapterAnnouncements
from app.adapters.resolver import ModelResolver
from app.admin.adapters.service import AdapterService
from app.db.database import Database
from app.demo.tenant import DemoAccess
from app.engine_clients.interface import EngineClient
from app.keys.authenticator import Authenticator
from app.limits.limiter import Limiter
from app.observability.metrics import GatewayMetrics
from app.openai.chat.service import OpenAIService
from app.openai.responses.service import ResponsesService
from app.settings import Settings
from app.usage.writer import UsageWriter


@dataclass(slots=True)
class Gateway:
    """Everything a handler reaches through ``app.state.gateway``."""

    settings: Settings
    engine: EngineClient
    database: Database
    authenticator: Authenticator
    writer: UsageWriter
    metrics: GatewayMetrics
    limiter: Limiter
    """Rate limits, concurrency and monthly budgets of the OpenAI routes (in Redis with LORAPLEX_REDIS_URL)."""
    openai: OpenAIService
    responses: ResponsesService
    """The Responses API: responses run as chat completions, stored per tenant in PostgreSQL."""
    resolver: ModelResolver
    key_secret: bytes
    """Secret of the keyed hash of API keys (admin code creating keys needs it)."""
    adapters: AdapterService
    """The admin side of adapters: uploads, pins, and removals that wait for the last request."""
    announcements: AdapterAnnouncements
    """Applies adapter deletes, unloads and pins announced by the other replicas."""
    demo: DemoAccess | None = None


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway
