"""One request as the engine tracks it: its tokens, its pages and how far its KV is computed."""

import enum
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.output.detokenizer import IncrementalDetokenizer
from engine.sampling.grammar import GrammarState
from engine.sampling.logprobs import TokenLogprob
from engine.sampling.penalty_counts import PenaltyCounts
from engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.adapters.adapter_cache import AdapterEntry

DEFAULT_TENANT = "default"  # the tenant of requests that name none


def block_id_array(page_ids: Iterable[int] = ()) -> "array[int]":
    """Page ids as a sequence holds them: C ints (int32), so a step's block table is their bytes laid end to end
    (engine/step/step_batch.py), not a Python loop over every id of every row."""
    return array("i", page_ids)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the caller aborted (or the client went away)
    ERROR = "error"  # the engine failed while running this sequence; the others went on


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's state. ``token_ids`` is the prompt followed by every token generated so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    adapter: "AdapterEntry | None" = None  # None: the base model
    tenant: str = DEFAULT_TENANT  # whose share of the engine this request uses (the fair policy's unit)
    holds_adapter: bool = False  # counted in the adapter's running sequences (it is resident for us)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in this sequence's pages
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache at first admission
    num_prompt_tokens_charged: int = 0  # the prompt up to here was charged to the tenant (a recompute is not)
    block_ids: "array[int]" = field(default_factory=block_id_array)  # its pages, in order
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks so far
    num_registered_blocks: int = 0  # full blocks already offered to the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    index: int = 0  # which of the request's n choices this is
    fork_pending: bool = False  # choice 0 of an n > 1 request whose prompt is not done: forks at its first token
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token so far, when asked
    prompt_logprobs_done: bool = False  # every prompt token's logprob is in prompt_logprobs
    grammar: GrammarState | None = None  # structured output: where the output is in its grammar
    penalty_counts: PenaltyCounts | None = None  # with penalties: its output's token counts, from the first step
    speculation_rate: float = 1.0  # recent share of its proposed tokens accepted (engine/speculative/speculation.py)
    num_steps_unspeculated: int = 0  # steps since it last proposed, while its rate is too low to propose

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed + self.index)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token has nothing before it
            self.prompt_logprobs_done = self.num_prompt_tokens == 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def append_token(self, token_id: int) -> str:
        """Add a generated token, decide whether the sequence is done, and return the new text."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)
        params = self.params
        stopped_by_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        # The grammar is complete once it took its end-of-sequence token, which ends the output even with ignore_eos.
        grammar_complete = self.grammar is not None and self.grammar.accept(token_id)
        stopped_by_token = stopped_by_token or grammar_complete
        delta = self.detokenizer.push(token_id, is_stop_token=stopped_by_token)
        if stopped_by_token or self.detokenizer.stopped:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            delta += self.detokenizer.flush()
        return delta
