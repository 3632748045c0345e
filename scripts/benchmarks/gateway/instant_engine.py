"""An engine double that answers at once, for measuring what the gateway itself costs.

:class:`InstantEngine` implements the app's ``EngineClient`` protocol with no model and no tokenizer:
prompts become a few ids derived from their length, and ``generate`` yields one output per token of
each of the request's ``n`` choices, all of them immediately (it never awaits), each choice's last one
finishing with "length". Asked for logprobs or prompt logprobs, it gives well-formed made-up ones (every
token equally likely among VOCAB_SIZE), so the gateway's shaping of them is measured too. Adapters are
accepted and remembered by name only. ``scripts/benchmarks/gateway/bench_gateway.py`` runs the real app on it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from app.engine_clients.interface import LOCAL_WORKER, AdapterInfo
from app.engine_clients.special_text import NO_MARKERS, MarkedChat, Markers
from engine import EngineStats, GrammarConstraint, GrammarError, RequestOutput, SamplingParams
from engine.errors import UnknownAdapterError
from engine.sampling.logprobs import TokenLogprob

DEFAULT_NUM_TOKENS = 16  # tokens per reply, as in the benchmark (max_tokens 16)
MODEL_NAME = "instant"
MAX_MODEL_LEN = 2048
CHARS_PER_TOKEN = 4  # about what a BPE tokenizer averages on English text
TOKENS_PER_MESSAGE = 4  # a chat template's role markers around each message
MAX_PROMPT_TOKENS = 512  # keeps any prompt well inside MAX_MODEL_LEN
WORD = " token"  # the text of every generated token
FIRST_TOKEN_ID = 100  # ids below are the special tokens of a real vocabulary
VOCAB_SIZE = 49_152  # the default model's
UNIFORM_LOGPROB = -math.log(VOCAB_SIZE)
POOL_PAGES, BLOCK_SIZE, PAGE_BYTES = 4096, 16, 16 * 9 * 2 * 3 * 64 * 4  # a small model's pool, for stats()


class InstantEngine:
    """The ``EngineClient`` protocol with an engine that takes no time."""

    def __init__(self, num_tokens: int = DEFAULT_NUM_TOKENS, model_name: str = MODEL_NAME) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
        self.num_tokens = num_tokens
        self.model_name = model_name
        self.max_model_len = MAX_MODEL_LEN
        self.max_prompt_chars = MAX_MODEL_LEN * CHARS_PER_TOKEN
        self.vocab_size = VOCAB_SIZE
        self._started = False
        self._adapters: set[str] = set()
        self._num_requests = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._started = False

    def is_ready(self) -> bool:
        return self._started

    def encode_prompt(self, prompt: str) -> list[int]:
        return _ids_for(len(prompt) // CHARS_PER_TOKEN)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        num_chars = sum(len(str(message.get("content") or "")) for message in messages)
        return _ids_for(num_chars // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE * len(messages))

    def mark_special_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_source: str
    ) -> MarkedChat:
        return MarkedChat(messages, tools)  # no tokenizer: no special token to keep request text from

    def encode_rendered(self, text: str, markers: Markers = NO_MARKERS) -> list[int]:
        return _ids_for(markers.num_chars(text) // CHARS_PER_TOKEN)

    def special_tokens(self) -> dict[str, str]:
        return {}

    def decode(self, token_ids: list[int]) -> str:
        return WORD * len(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return WORD.encode()

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Per choice, one output per token, all at once: ``min(num_tokens, max_tokens)`` tokens, then "length".

        ``max_tokens`` 0 (scoring the prompt) gives each choice one output with no token.
        """
        if adapter is not None and adapter not in self._adapters:
            raise UnknownAdapterError(f"unknown adapter {adapter!r}")
        num_tokens = min(self.num_tokens, params.max_tokens)
        self._num_requests += 1
        self._num_prompt_tokens += len(prompt_ids)
        prompt_logprobs = _prompt_logprobs(prompt_ids, params.prompt_logprobs)
        for choice in range(params.n):
            last_choice = choice == params.n - 1
            if num_tokens == 0:
                yield _output(request_id, prompt_ids, [], [], "length", choice, last_choice, None, prompt_logprobs)
                continue
            token_ids: list[int] = []
            logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
            for position in range(num_tokens):
                token_id = FIRST_TOKEN_ID + position
                token_ids.append(token_id)
                if logprobs is not None:
                    logprobs.append(_uniform(token_id, params.logprobs or 0))
                self._num_generated_tokens += 1
                last = position == num_tokens - 1
                yield _output(
                    request_id,
                    prompt_ids,
                    list(token_ids),
                    [token_id],
                    "length" if last else None,
                    choice,
                    last and last_choice,
                    logprobs,
                    prompt_logprobs,
                )

    def abort_all(self) -> None:
        """Nothing to end: every reply is complete the moment it starts."""

    async def check_constraint(self, constraint: GrammarConstraint) -> None:
        raise GrammarError("structured output needs a tokenizer, and the instant engine has none; serve a real model")

    async def validate_adapter(self, path: Path) -> AdapterInfo:
        return AdapterInfo(
            digest=hashlib.sha256(str(path).encode()).hexdigest(),
            rank=8,
            alpha=16.0,
            target_modules=("q_proj", "v_proj"),
            size_bytes=0,
        )

    async def add_adapter(self, name: str, path: Path) -> str:
        self._adapters.add(name)
        return (await self.validate_adapter(path)).digest

    async def remove_adapter(self, name: str) -> None:
        self._adapters.discard(name)

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    async def worker_stats(self) -> dict[str, EngineStats]:
        return {LOCAL_WORKER: await self.stats()}

    async def stats(self) -> EngineStats:
        return EngineStats(
            num_pages=POOL_PAGES,
            block_size=BLOCK_SIZE,
            page_bytes=PAGE_BYTES,
            pages_by_owner={"free": POOL_PAGES},
            num_running=0,
            num_waiting=0,
            num_resident_adapters=len(self._adapters),
            num_preemptions=0,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_prompt_tokens=0,
            num_generated_tokens=self._num_generated_tokens,
        )


def _output(
    request_id: str,
    prompt_ids: list[int],
    token_ids: list[int],
    delta_token_ids: list[int],
    finish_reason: str | None,
    index: int,
    request_finished: bool,
    logprobs: list[TokenLogprob] | None,
    prompt_logprobs: list[TokenLogprob | None] | None,
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        text=WORD * len(token_ids),
        delta_token_ids=delta_token_ids,
        delta_text=WORD * len(delta_token_ids),
        finish_reason=finish_reason,
        num_cached_tokens=0,
        ttft_s=0.0,
        index=index,
        request_finished=request_finished,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _uniform(token_id: int, num_top: int) -> TokenLogprob:
    """A made-up entry: the token and ``num_top`` others, all equally likely."""
    top = tuple((token_id + k, UNIFORM_LOGPROB) for k in range(num_top))
    return TokenLogprob(token_id, UNIFORM_LOGPROB, top)


def _prompt_logprobs(prompt_ids: list[int], num_top: int | None) -> list[TokenLogprob | None] | None:
    if num_top is None:
        return None
    return [None, *(_uniform(token_id, num_top) for token_id in prompt_ids[1:])]


def _ids_for(num_tokens: int) -> list[int]:
    """A prompt of ``num_tokens`` ids (at least one, at most MAX_PROMPT_TOKENS)."""
    return list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + min(max(num_tokens, 1), MAX_PROMPT_TOKENS)))
