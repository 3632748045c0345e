"""A choice's outputs as deltas, so an engine elsewhere sends each token, logprob and character once.

In one process an output's ``token_ids`` and ``logprobs`` are the engine's own growing lists, so handing
one over costs nothing. Across a process boundary the totals would be sent again every step (quadratic
in the output's length), so the worker's :class:`DeltaEncoder` sends what is new since the choice's
previous output, and the client's :class:`OutputAssembler` appends it to lists of its own and hands out
:class:`RequestOutput`\\ s as the engine made them (growing lists included).

The text is rebuilt from the streamed deltas plus ``held_text``: what the engine's detokenizer holds back
because it may be the start of a stop string (it only ever hands out a prefix of its text).
"""

from dataclasses import dataclass, field

import msgspec

from engine.output.outputs import RequestOutput
from engine.sampling.logprobs import TokenLogprob


class OutputDelta(msgspec.Struct, frozen=True, array_like=True):
    """What one output adds to its choice since the choice's previous output."""

    request_id: str
    index: int
    new_token_ids: list[int]
    """Tokens appended to the choice's ``token_ids`` since its previous output."""
    delta_token_ids: list[int] | None
    """The output's ``delta_token_ids``; None when they are ``new_token_ids`` (always, with today's engine)."""
    delta_text: str
    held_text: str
    """The end of the output's text not streamed yet (it might start a stop string)."""
    finish_reason: str | None
    num_cached_tokens: int
    ttft_s: float | None
    error: str | None
    request_finished: bool
    new_logprobs: list[TokenLogprob] | None
    """Entries appended to ``logprobs`` since the previous output; None when the choice has no logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None
    """Sent once, with the choice's first output that has them."""


@dataclass(slots=True)
class _Sent:
    """How much of one choice the client has already been sent."""

    num_tokens: int = 0
    num_chars: int = 0  # of streamed text: the deltas' total
    num_logprobs: int = 0
    prompt_logprobs: bool = False


class DeltaEncoder:
    """The worker's side: each output as a delta against what its choice was sent before."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        choices = self._sent.setdefault(output.request_id, {})
        sent = choices.get(output.index)
        if sent is None:
            sent = choices[output.index] = _Sent()
        new_token_ids = output.token_ids[sent.num_tokens :]
        sent.num_tokens = len(output.token_ids)
        sent.num_chars += len(output.delta_text)
        new_logprobs = None
        if output.logprobs is not None:
            new_logprobs = output.logprobs[sent.num_logprobs :]
            sent.num_logprobs = len(output.logprobs)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not sent.prompt_logprobs:
            prompt_logprobs = output.prompt_logprobs
            sent.prompt_logprobs = True
        if output.request_finished:
            del self._sent[output.request_id]
        return OutputDelta(
            request_id=output.request_id,
            index=output.index,
            new_token_ids=new_token_ids,
            delta_token_ids=None if output.delta_token_ids == new_token_ids else list(output.delta_token_ids),
            delta_text=output.delta_text,
            held_text=output.text[sent.num_chars :],
            finish_reason=output.finish_reason,
            num_cached_tokens=output.num_cached_tokens,
            ttft_s=output.ttft_s,
            error=output.error,
            request_finished=output.request_finished,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def forget(self, request_id: str) -> None:
        """Drop what was sent of a request nobody reads any more (aborted by its client)."""
        self._sent.pop(request_id, None)


@dataclass(slots=True)
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    streamed_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class OutputAssembler:
    """The client's side, for one request: its deltas back into RequestOutputs, choice by choice."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._choices: dict[int, _Choice] = {}

    def apply(self, delta: OutputDelta) -> RequestOutput:
        choice = self._choices.get(delta.index)
        if choice is None:
            choice = self._choices[delta.index] = _Choice()
        choice.token_ids.extend(delta.new_token_ids)
        # ``choice.streamed_text += ...`` would copy the whole text every delta: CPython grows a string in place only
        # when its one reference is a local variable (outputs handed out before hold it too until they are dropped)
        text, choice.streamed_text = choice.streamed_text, ""
        text += delta.delta_text
        choice.streamed_text = text
        if delta.new_logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        return RequestOutput(
            request_id=delta.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=choice.token_ids,
            text=choice.streamed_text + delta.held_text,
            delta_token_ids=delta.new_token_ids if delta.delta_token_ids is None else delta.delta_token_ids,
            delta_text=delta.delta_text,
            finish_reason=delta.finish_reason,
            num_cached_tokens=delta.num_cached_tokens,
            ttft_s=delta.ttft_s,
            error=delta.error,
            index=delta.index,
            request_finished=delta.request_finished,
            logprobs=choice.logprobs,
            prompt_logprobs=choice.prompt_logprobs,
        )
