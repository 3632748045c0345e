"""The engine's log-probabilities in OpenAI's shapes (and vLLM's for ``prompt_logprobs``).

A token is named by its bytes decoded as UTF-8, or, when they are not valid UTF-8 on their own (a token
that holds part of a character), in OpenAI's form ``bytes:\\xe2\\x80``. Chat entries carry the bytes
themselves too, so a client can join the parts of a character.

The engine appends to a choice's logprobs list as it generates; an output's own tokens are the first
``len(output.token_ids)`` entries, the delta's the last ``len(output.delta_token_ids)`` of those.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from app.engine_clients.interface import EngineClient
from app.openai.chat.reply_schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from engine import RequestOutput
from engine.sampling.logprobs import TokenLogprob


def token_text(data: bytes) -> str:
    """A token's text: its bytes as UTF-8, or ``bytes:\\xNN...`` when they are not valid UTF-8 alone."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def delta_logprobs(output: RequestOutput) -> Sequence[TokenLogprob]:
    """The entries of the output's new tokens (none when the request asked for no logprobs)."""
    if output.logprobs is None:
        return ()
    end = len(output.token_ids)
    return output.logprobs[end - len(output.delta_token_ids) : end]


def all_logprobs(output: RequestOutput) -> Sequence[TokenLogprob]:
    """The entries of every token the choice generated so far."""
    return () if output.logprobs is None else output.logprobs[: len(output.token_ids)]


def chat_logprobs(entries: Sequence[TokenLogprob], num_top: int, engine: EngineClient) -> ChatLogprobs:
    """Chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, ``num_top`` alternatives each."""
    content = []
    for entry in entries:
        data = engine.token_bytes(entry.token_id)
        tops = []
        for token_id, logprob in entry.top[:num_top]:
            top_data = engine.token_bytes(token_id)
            tops.append(TopLogprob(token=token_text(top_data), logprob=logprob, bytes=list(top_data)))
        content.append(
            ChatTokenLogprob(token=token_text(data), logprob=entry.logprob, bytes=list(data), top_logprobs=tops)
        )
    return ChatLogprobs(content=content)


class CompletionLogprobsShaper:
    """One choice's completions logprobs, piece by piece: its ``text_offset`` runs on across pieces.

    A token's offset is where it starts in the text returned (the echoed prompt first, when asked): the
    characters the tokens before it decode to, a character split over two tokens counted once, complete.
    """

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def prompt(
        self, prompt_ids: list[int], scores: Sequence[TokenLogprob | None] | None, num_top: int, text: str
    ) -> CompletionLogprobs:
        """The echoed prompt's tokens (the first without a logprob); the completion's offsets start after ``text``."""
        scored = list(scores) if scores is not None else [None] * len(prompt_ids)
        entries = [(token_id, score) for token_id, score in zip(prompt_ids, scored, strict=False)]
        shaped = self._shape(entries, num_top)
        self._offset, self._decoder = len(text), codecs.getincrementaldecoder("utf-8")(errors="replace")
        return shaped

    def generated(self, entries: Sequence[TokenLogprob], num_top: int) -> CompletionLogprobs:
        return self._shape([(entry.token_id, entry) for entry in entries], num_top)

    def _shape(self, entries: list[tuple[int, TokenLogprob | None]], num_top: int) -> CompletionLogprobs:
        shaped = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, entry in entries:
            data = self._engine.token_bytes(token_id)
            shaped.tokens.append(token_text(data))
            shaped.text_offset.append(self._offset)
            self._offset += len(self._decoder.decode(data))
            if entry is None:
                shaped.token_logprobs.append(None)
                shaped.top_logprobs.append(None)
                continue
            shaped.token_logprobs.append(entry.logprob)
            tops = {token_text(self._engine.token_bytes(top_id)): logprob for top_id, logprob in entry.top[:num_top]}
            tops.setdefault(shaped.tokens[-1], entry.logprob)  # OpenAI's dict holds the sampled token too
            shaped.top_logprobs.append(tops)
        return shaped


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def prompt_logprobs(
    scores: Sequence[TokenLogprob | None] | None, num_top: int, engine: EngineClient
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first null), the token and ``num_top`` alternatives."""
    if scores is None:
        return None
    shaped: PromptLogprobs = []
    for entry in scores:
        if entry is None:
            shaped.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, start=1)}
        position = {entry.token_id: _entry(entry.token_id, entry.logprob, ranks.get(entry.token_id), engine)}
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            position.setdefault(token_id, _entry(token_id, logprob, rank, engine))
        shaped.append(position)
    return shaped


def _entry(token_id: int, logprob: float, rank: int | None, engine: EngineClient) -> PromptLogprob:
    return PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_text(engine.token_bytes(token_id)))
