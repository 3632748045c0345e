"""What the engine hands back: per-request deltas and results, and its own statistics."""

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's progress after one step (``delta_*``) and its totals so far."""

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(
        cls, seq: Sequence, delta_token_ids: list[int], delta_text: str, error: str | None = None
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
    scheduling_policy: str = "fair"  # "fair" (per-tenant virtual token counters) or "fifo"
    tenant_counters: dict[str, float] = field(default_factory=dict)  # fair policy: each tenant's weighted service
