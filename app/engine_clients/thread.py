"""An engine on a thread of this process, behind the EngineClient interface (``LORAPLEX_ENGINE=thread``).

Its step loop runs on a thread of its own (:class:`AsyncEngine`), which also builds the engine (the thread
that steps an engine should be the one that built it: ``engine/drivers/engine_build.py``), and shares the GIL with
the event loop; the default runs the engine in a worker process instead (app/engine_clients/process.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from app.engine_clients.interface import LOCAL_WORKER, AdapterInfo
from app.engine_clients.tokenizer import GatewayTokenizer, TokenizingClient
from engine import EngineConfig, EngineStats, GrammarConstraint, RequestOutput, SamplingParams
from engine.drivers.async_engine import AsyncEngine


class LocalEngineClient(TokenizingClient):
    """An engine in this process, its step loop on a thread of its own."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.max_model_len = 0
        self.max_prompt_chars = 0
        self.vocab_size = 0
        self._engine: AsyncEngine | None = None
        self._tokenizer: GatewayTokenizer | None = None

    async def start(self) -> None:
        """Start the step loop, which first loads the model (seconds, off the event loop); Engine(config)'s errors."""
        if self._engine is not None:
            return
        async_engine = AsyncEngine(self.config)
        try:
            await asyncio.wrap_future(async_engine.start())
        except asyncio.CancelledError:
            async_engine.request_stop()  # its step thread ends once the engine it is building is built
            raise
        engine = async_engine.engine
        self._tokenizer = GatewayTokenizer(engine.tokenizer, engine.token_bytes)
        self.max_model_len = engine.max_model_len
        self.max_prompt_chars = self._tokenizer.max_prompt_chars(engine.max_model_len)
        self.vocab_size = engine.model_config.vocab_size
        self._engine = async_engine

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.stop()
            self._engine = None

    def is_ready(self) -> bool:
        """True once started, while the step loop runs (false after it died: ``/ready`` answers 503)."""
        return self._engine is not None and self._engine.is_running

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("the engine client is not started")
        return self._engine

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        # aclosing: a caller that stops early (a client gone) aborts the request now, not at garbage collection.
        outputs = self.engine.generate(prompt_ids, params, request_id, adapter, tenant, weight)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    def abort_all(self) -> None:
        self.engine.abort_all()

    async def check_constraint(self, constraint: GrammarConstraint) -> None:
        await self.engine.compile_grammar(constraint)

    async def validate_adapter(self, path: Path) -> AdapterInfo:
        """Check a PEFT folder against the base model without registering it (AdapterError if unusable)."""
        adapter = await asyncio.to_thread(self.engine.engine.validate_adapter, path)
        return AdapterInfo(
            digest=adapter.digest,
            rank=max(adapter.ranks.values()),
            alpha=adapter.lora_alpha,
            target_modules=adapter.modules,
            size_bytes=adapter.size_bytes,
        )

    async def add_adapter(self, name: str, path: Path) -> str:
        return await self.engine.add_adapter(name, path)

    async def remove_adapter(self, name: str) -> None:
        await self.engine.remove_adapter(name)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self.engine.call(lambda engine: engine.pin_adapter(name, pinned))

    def has_adapter(self, name: str) -> bool:
        return self.engine.engine.has_adapter(name)

    async def stats(self) -> EngineStats:
        return await self.engine.call(lambda engine: engine.stats())

    async def worker_stats(self) -> dict[str, EngineStats]:
        return {LOCAL_WORKER: await self.stats()}
