"""What the engine hands back: per-choice deltas and results, and its own statistics."""

from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One choice's progress after one step (``delta_*``) and its totals so far.

    A request with ``n`` choices yields outputs for each ``index`` in 0..n-1; ``finished`` is this
    choice's end, ``request_finished`` that of the request's last choice.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finish_reason: str | None
    num_cached_tokens: int
    ttft_s: float | None  # seconds from arrival to the first generated token
    error: str | None = None  # finish_reason "error": what went wrong, for the logs (not for end users)
    index: int = 0  # the choice, 0..n-1
    request_finished: bool = False  # every choice of the request has finished
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids`` (the engine appends to it)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(
        cls,
        seq: Sequence,
        delta_token_ids: list[int],
        delta_text: str,
        error: str | None = None,
        request_finished: bool = False,
    ) -> "RequestOutput":
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.detokenizer.text,
            delta_token_ids=delta_token_ids,
            delta_text=delta_text,
            finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
            num_cached_tokens=seq.num_cached_tokens,
            ttft_s=ttft,
            error=error,
            index=seq.index,
            request_finished=request_finished,
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs if seq.prompt_logprobs_done else None,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_pages: int
    block_size: int
    page_bytes: int
    pages_by_owner: dict[str, int]
    num_running: int
    num_waiting: int
    num_resident_adapters: int
    num_preemptions: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_prefill_tokens: int = 0  # prompt tokens run through the model (a recompute counts again, a cache hit not)
    num_kv_blocks_allocated: int = 0  # KV pages ever handed to sequences, copies on write included
    scheduling_policy: str = "fair"  # "fair" (per-tenant virtual token counters) or "fifo"
    tenant_counters: dict[str, float] = field(default_factory=dict)  # fair policy: each tenant's weighted service
    running_adapters: list[str] = field(default_factory=list)  # engine names of running sequences' adapters, sorted
    waiting_adapters: list[str] = field(default_factory=list)  # the same for waiting sequences
    max_adapters: int = 0  # adapters the engine can hold at once (AdapterCache.capacity)
    num_registered_adapters: int = 0  # adapters registered (host tier), resident in the pool or not
    num_proposed_tokens: dict[str, int] = field(default_factory=dict)  # speculative proposals, by adapter ("": base)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)  # the proposed tokens verification accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed speculative tokens since the engine started (0 before any proposal)."""
        proposed = sum(self.num_proposed_tokens.values())
        return sum(self.num_accepted_tokens.values()) / proposed if proposed else 0.0
