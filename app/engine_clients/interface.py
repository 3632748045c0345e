"""The app's only way to the engine (DESIGN.md §10): submit a request, iterate its outputs, abort.

:class:`EngineClient` is the interface; :class:`LocalEngineClient` runs an :class:`AsyncEngine` in
this process. A remote worker would implement the same methods over the network, so nothing in
``app/`` may reach past this interface into the engine's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.engine_clients.tokenizer import GatewayTokenizer, TokenizingClient
from engine import Engine, EngineConfig, EngineStats, GrammarConstraint, RequestOutput, SamplingParams
from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT = 1.0  # the engine's weight for a tenant it was never given one for
LOCAL_WORKER = "local"  # the worker id of an engine on this machine (a thread or a process of its own)


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What the engine's validator found in a PEFT folder (the adapters table records it)."""

    digest: str
    rank: int
    """The largest rank over the adapter's modules."""
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int


class EngineClient(Protocol):
    """What the gateway needs from an engine, wherever it runs."""

    model_name: str
    """The base model's name in the API."""
    max_model_len: int
    """Most tokens a request may hold, prompt and completion together."""
    max_prompt_chars: int
    """Longest text that could fit in the context; a longer prompt is refused without tokenizing it."""
    vocab_size: int
    """Token ids run from 0 to this, excluded (prompts, ``logit_bias``, ``stop_token_ids`` are checked against it)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_ready(self) -> bool: ...

    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids as the model's tokenizer writes it (special tokens kept), for ``echo``."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token adds to a text (may be part of a character), for logprobs."""
        ...

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, for each of its ``params.n`` choices (``output.index``) until ``request_finished``.

        ``tenant`` and its ``weight`` are whose fair share of the engine it uses.
        """
        ...

    def abort_all(self) -> None:
        """End every request in flight now; their output streams end with finish reason "abort"."""
        ...

    async def check_constraint(self, constraint: GrammarConstraint) -> None:
        """Compile a structured-output constraint off the event loop (cached); GrammarError says why it cannot be."""
        ...

    async def validate_adapter(self, path: Path) -> AdapterInfo: ...

    async def add_adapter(self, name: str, path: Path) -> str: ...

    async def remove_adapter(self, name: str) -> None:
        """Forget an adapter and free its pages; AdapterBusyError while unfinished requests use it."""
        ...

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """Keep an adapter resident in the pool (loading it now), or let it be evicted again."""
        ...

    def has_adapter(self, name: str) -> bool: ...

    async def stats(self) -> EngineStats: ...

    async def worker_stats(self) -> dict[str, EngineStats]:
        """Each engine worker's stats by worker id (``LOCAL_WORKER`` for an engine on this machine)."""
        ...


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
        self._weights: dict[str, float] = {}  # the weight last given to the engine, per tenant

    async def start(self) -> None:
        """Load the model (off the event loop: it takes seconds) and start the step loop."""
        if self._engine is not None:
            return
        engine = await asyncio.to_thread(Engine, self.config)
        self._tokenizer = GatewayTokenizer(engine.tokenizer, engine.token_bytes)
        self.max_model_len = engine.max_model_len
        self.max_prompt_chars = self._tokenizer.max_prompt_chars(engine.max_model_len)
        self.vocab_size = engine.model_config.vocab_size
        self._engine = AsyncEngine(engine)
        self._engine.start()

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.stop()
            self._engine = None

    def is_ready(self) -> bool:
        return self._engine is not None

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
        if tenant is not None and self._weights.get(tenant, DEFAULT_WEIGHT) != weight:
            await self.engine.set_tenant_weight(tenant, weight)  # rare: only when a tenant's weight changes
            self._weights[tenant] = weight
        # aclosing: a caller that stops early (a client gone) aborts the request now, not at garbage collection.
        outputs = self.engine.generate(prompt_ids, params, request_id=request_id, adapter=adapter, tenant=tenant)
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
