"""The app's only way to the engine (docs/architecture.md): submit a request, iterate its outputs, abort.

:class:`EngineClient` is the interface. Its implementations: an engine on a thread of this process
(app/engine_clients/thread.py), in a worker process of its own (app/engine_clients/process.py), or as
replicas on Ray Serve (app/cluster/ray_client.py). Nothing in ``app/`` may reach past this interface into
the engine's state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.engine_clients.special_text import NO_MARKERS, MarkedChat, Markers
from engine import EngineStats, GrammarConstraint, RequestOutput, SamplingParams

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

    def encode_prompt(self, prompt: str) -> list[int]:
        """The token ids of a completion's prompt: the client's whole text, its special tokens parsed."""
        ...

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The token ids of a chat by the tokenizer's own template; no text of the messages becomes a special token."""
        ...

    def mark_special_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_source: str
    ) -> MarkedChat:
        """A chat for ``template_source`` to render, each special token's text in its strings a marker
        (app/engine_clients/special_text.py); SpecialTextError when no marker is free."""
        ...

    def encode_rendered(self, text: str, markers: Markers = NO_MARKERS) -> list[int]:
        """The token ids of a prompt a chat template rendered (no special token added), each of the marked chat's
        ``markers`` as its special token's text in ordinary tokens."""
        ...

    def special_tokens(self) -> dict[str, str]:
        """The tokenizer's named special tokens (``bos_token``, ``eos_token``, ...), which a chat template writes."""
        ...

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
