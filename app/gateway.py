"""The composition root: the gateway's services built and started in the app's lifespan, stopped in reverse order.

What it builds is the :class:`~app.services.Gateway` record, which handlers read; nothing else in ``app/``
imports this module (tests/app/test_layout.py checks it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from datetime import timedelta
from pathlib import Path

from litestar import Litestar
from sqlalchemy import make_url

from app.adapters.announcements import AdapterAnnouncements
from app.adapters.resolver import ModelResolver
from app.admin.adapters.service import AdapterService
from app.admin.keys.first_admin import ensure_admin_key, warn_of_void_admin_keys
from app.cluster.environment import configure_ray_environment
from app.db.database import Database
from app.db.embedded import EmbeddedPostgres
from app.db.migrate import upgrade
from app.demo.tenant import ensure_demo_tenant
from app.engine_clients.interface import EngineClient
from app.engine_clients.process import ProcessEngineClient
from app.engine_clients.thread import LocalEngineClient
from app.keys.authenticator import Authenticator
from app.keys.secrets import load_or_create_key_secret
from app.limits.budget import usage_loader
from app.limits.factory import open_limiter
from app.model_store import resolve_model
from app.observability.metrics import GatewayMetrics
from app.openai.chat.service import OpenAIService
from app.openai.responses.service import ResponsesService
from app.openai.responses.storage import ResponseStore
from app.openai.responses.sweeper import ResponseSweeper
from app.services import Gateway
from app.settings import Settings, SettingsError
from app.tool_calls.style import ChatStyle, base_chat_style
from app.tool_calls.templates import ChatTemplateError
from app.usage.writer import UsageWriter
from engine import EngineConfig

logger = logging.getLogger(__name__)

USAGE_SPOOL_STEM = "usage-spool"  # usage-spool.jsonl: usage not in the database yet, fsync'd; read back at start


class StartupStopped(Exception):
    """A stop (SIGTERM or Ctrl-C) came while the engine was starting: the gateway stops instead of serving."""


def make_engine(settings: Settings, database_url: str | None = None) -> EngineClient:
    """The engine client the settings ask for, on the configured model (pulled on first use when it is the default).

    ``database_url`` is where Ray replicas fetch adapters from (the local engines read the data folder).

    In a worker process of its own (``LORAPLEX_ENGINE=local``, the default), on a thread of this one, or
    as replicas on Ray Serve (``LORAPLEX_ENGINE=ray``; Ray is imported only then).
    """
    folder = resolve_model(settings.model, settings.home)
    config = EngineConfig(
        model=str(folder),
        pool_bytes=settings.pool_bytes,
        max_num_seqs=settings.max_num_seqs,
        dtype=settings.dtype,
        quantization=settings.quantization,
        bf16_gemm=settings.bf16_gemm,
        num_speculative_tokens=settings.num_speculative_tokens,
        cuda_graphs=settings.cuda_graphs,
        launch_ahead=None if settings.launch_ahead else False,  # None: where it pays (CUDA)
    )
    name = settings.served_model_name or folder.name
    if settings.engine == "thread":
        return LocalEngineClient(config, name)
    if settings.engine == "ray":
        configure_ray_environment()  # before Ray is imported: Serve reads its settings then
        try:
            from app.cluster.deployment import RaySettings
            from app.cluster.ray_client import RayEngineClient
        except ModuleNotFoundError as error:
            raise SettingsError(
                f"LORAPLEX_ENGINE=ray needs Ray Serve ({error}); install it with pip install 'loraplex[ray]'"
            ) from None
        ray_settings = RaySettings(
            settings.ray_address,
            settings.ray_replicas,
            settings.ray_replica_cpus,
            settings.ray_replica_gpus,
            settings.ray_output_port,
        )
        return RayEngineClient(config, name, settings.home, ray_settings, database_url)
    return ProcessEngineClient(config, name)


@asynccontextmanager
async def run_gateway(
    settings: Settings,
    engine: EngineClient | None = None,
    demo_adapters: dict[str, Path] | None = None,
    stopping: asyncio.Event | None = None,
) -> AsyncIterator[Gateway]:
    """Start the database, the engine and the background writers; stop them all on the way out.

    An ``engine`` passed in is used as it is and left running (tests share one between apps).
    """
    async with AsyncExitStack() as stack:
        # Pushed first, so it runs last: once this line is logged, the usage is written and everything closed.
        stack.callback(logger.info, "gateway stopped: usage written, engine and database closed")
        url = settings.database_url
        if url is None:
            embedded = EmbeddedPostgres(settings.home / "postgres")
            url = await asyncio.to_thread(embedded.start)
            stack.callback(embedded.stop)
        shown_url = make_url(url).render_as_string(hide_password=True)
        logger.info("database: %s%s", shown_url, " (embedded)" if settings.database_url is None else "")
        if settings.migrate_on_start:
            applied = await asyncio.to_thread(upgrade, url)
            logger.info(
                "database schema up to date%s",
                f": applied {len(applied)} migrations ({', '.join(applied)})" if applied else ", no migration to apply",
            )
        database = Database(url)
        stack.push_async_callback(database.close)
        # The writer stops after the engine, so the usage of requests the engine aborts is still written.
        writer = UsageWriter(
            database,
            spool_folder=settings.home,
            spool_stem=USAGE_SPOOL_STEM,
            spool_max_bytes=settings.usage_spool_max_bytes,
        )
        writer.start()
        stack.push_async_callback(writer.stop)
        key_secret = load_or_create_key_secret(settings.home, settings.key_secret)
        authenticator = Authenticator(database, key_secret)
        authenticator.start()
        stack.push_async_callback(authenticator.stop)
        metrics = GatewayMetrics()
        # The limiter closes after the engine stops, so the settles of requests the engine ends still reach Redis.
        limiter = await stack.enter_async_context(
            open_limiter(settings, usage_loader(database), metrics.limit_backend_errors)
        )
        if engine is None:
            engine = make_engine(settings, url)
            await _start_unless_stopped(engine, stopping)
            stack.push_async_callback(engine.stop)
        resolver = ModelResolver(database, engine, settings.home)
        adapters = AdapterService(database, engine, resolver, settings)
        stack.push_async_callback(adapters.close)

        def forget_tenant(tenant_id: uuid.UUID) -> None:
            authenticator.forget_tenant(tenant_id)
            resolver.forget_tenant(tenant_id)

        announcements = AdapterAnnouncements(
            database, engine, resolver, adapters.retire, adapters.unload_here, forget_tenant
        )
        await announcements.start()
        stack.push_async_callback(announcements.stop)
        demo = None
        if settings.demo:
            demo = await ensure_demo_tenant(database, engine, settings.home, key_secret, demo_adapters or {})
        if settings.admin_key:
            await ensure_admin_key(database, key_secret, settings.admin_key)
        await warn_of_void_admin_keys(database)
        response_store = ResponseStore(database, timedelta(days=settings.response_retention_days))
        sweeper = ResponseSweeper(response_store)
        sweeper.start()
        stack.push_async_callback(sweeper.stop)
        openai = OpenAIService(
            engine,
            resolver,
            writer,
            metrics,
            limiter,
            max_n=settings.max_n,
            max_prompts=settings.max_prompts,
            base_style=_base_style(settings),
            share_base_prefix_cache=settings.share_base_prefix_cache,
        )
        gateway = Gateway(
            settings=settings,
            engine=engine,
            database=database,
            authenticator=authenticator,
            writer=writer,
            metrics=metrics,
            limiter=limiter,
            openai=openai,
            responses=ResponsesService(openai, response_store),
            resolver=resolver,
            key_secret=key_secret,
            adapters=adapters,
            announcements=announcements,
            demo=demo,
        )
        yield gateway


async def _start_unless_stopped(engine: EngineClient, stopping: asyncio.Event | None) -> None:
    """``engine.start()``, given up when ``stopping`` is set first (SIGTERM or Ctrl-C while it starts: a Ray
    deployment can wait for resources without end): the start is cancelled and StartupStopped raised, so the
    gateway closes what it opened and the server exits."""
    start = asyncio.ensure_future(engine.start())
    if stopping is None:
        await start
        return
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if start.done():
        start.result()  # the start's own error, if it failed
        return
    logger.warning("a stop was asked for while the engine was starting: not waiting for it")
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)  # the client's own clean-up of a start cut short
    raise StartupStopped("the gateway was stopped while its engine was starting")


def _base_style(settings: Settings) -> ChatStyle:
    try:
        return base_chat_style(settings.chat_template, settings.tool_call_format)
    except ChatTemplateError as error:
        raise SettingsError(f"LORAPLEX_CHAT_TEMPLATE, LORAPLEX_TOOL_CALL_FORMAT: {error}") from None


def gateway_lifespan(
    settings: Settings, engine: EngineClient | None, demo_adapters: dict[str, Path] | None
) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the gateway runs while the app does, in ``app.state.gateway``."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with run_gateway(settings, engine, demo_adapters, app.state.stopping) as gateway:
            app.state.gateway = gateway
            yield

    return lifespan
