"""What the engine hands back: per-choice deltas and results, and its own statistics."""

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from engine.output.token_view import TokenView
from engine.sampling.logprobs import TokenLogprob
from engine.scheduling.sequence import Sequence


# Not frozen, as the other per-row records of a step (ScheduledSeq, Verified): one is made for every row of every
# step, and a frozen dataclass's __init__ sets each field through object.__setattr__. Treat it as read-only.
@dataclass(slots=True)
class RequestOutput:
    """One choice's progress after one step (``delta_*``) and its totals so far.

    A request with ``n`` choices yields outputs for each ``index`` in 0..n-1; ``finished`` is this
    choice's end, ``request_finished`` that of the request's last choice.
    """

    request_id: str
    """The id ``add_request`` returned."""

    prompt_token_ids: list[int]
    """The prompt, as token ids."""

    token_ids: SequenceOf[int]
    """Every token this choice generated so far: a list, or from the engine a read-only view of its own list
    (``TokenView``, equal to the list of the same ids; ``list()`` makes a copy)."""

    text: str
    """``token_ids`` as text so far (stop strings cut, never shown even partly)."""

    delta_token_ids: list[int]
    """The tokens this step added."""

    delta_text: str
    """The text this step added."""

    finish_reason: str | None
    """None while running; then "stop", "length", "abort" or "error"."""

    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""

    ttft_s: float | None
    """Seconds from arrival to the first generated token; None before it."""

    error: str | None = None
    """With finish reason "error": what went wrong, for the logs (not for end users)."""

    index: int = 0
    """The choice, 0..n-1."""

    request_finished: bool = False
    """Every choice of the request has finished."""

    logprobs: list[TokenLogprob] | None = None
    """With ``SamplingParams.logprobs``: one per token of ``token_ids`` (the engine appends to it)."""

    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one per prompt token, the first None."""

    @property
    def finished(self) -> bool:
        """This choice has ended."""
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
        """The output of ``seq`` after a step that added ``delta_token_ids`` (engine-internal)."""
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=TokenView(seq.token_ids, seq.num_prompt_tokens, seq.num_tokens),
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


def ended_before_admission(request_id: str, prompt_token_ids: list[int], n: int) -> list[RequestOutput]:
    """The last outputs of a request ended (finish reason "abort") before the engine admitted it: every
    choice, no token (one still compiling its grammar when every request was ended)."""
    return [
        RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=[],
            text="",
            delta_token_ids=[],
            delta_text="",
            finish_reason="abort",
            num_cached_tokens=0,
            ttft_s=None,
            index=index,
            request_finished=index == n - 1,
        )
        for index in range(n)
    ]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine: its pool, its queues, and counters since it started (``Engine.stats()``)."""

    num_pages: int
    """Pages in the unified pool."""

    block_size: int
    """Tokens per KV page."""

    page_bytes: int
    """Bytes of one page (all layers)."""

    pages_by_owner: dict[str, int]
    """Pages by owner kind: "free", "kv", "prefix_cache", "adapter", "scratch" (one page with CUDA graphs)."""

    num_running: int
    """Sequences in the running batch."""

    num_waiting: int
    """Sequences waiting for admission."""

    num_resident_adapters: int
    """Adapters with their pages in the pool now."""

    num_preemptions: int
    """Sequences preempted (to be recomputed) since the start."""

    num_prompt_tokens: int
    """Prompt tokens of every request admitted."""

    num_cached_prompt_tokens: int
    """Of those, tokens served from the prefix cache."""

    num_generated_tokens: int
    """Tokens generated."""

    num_prefill_tokens: int = 0
    """Prompt tokens run through the model (a recompute counts again, a cache hit not)."""

    num_kv_blocks_allocated: int = 0
    """KV pages ever handed to sequences, copies on write included."""

    scheduling_policy: str = "fair"
    """ "fair" (per-tenant virtual token counters) or "fifo"."""

    tenant_counters: dict[str, float] = field(default_factory=dict)
    """Under the fair policy: each tenant's weighted service so far."""

    running_adapters: list[str] = field(default_factory=list)
    """Engine names of the running sequences' adapters, sorted."""

    waiting_adapters: list[str] = field(default_factory=list)
    """The same for waiting sequences."""

    max_adapters: int = 0
    """Adapters the engine can hold at once (rank-16 adapters on every projection in half the pool)."""

    num_registered_adapters: int = 0
    """Adapters registered (host tier), resident in the pool or not."""

    dtype: str = "float32"
    """The model's dtype ("auto" resolved)."""

    activation_dtype: str = "float32"
    """The dtype of activations (float32 on the native CPU kernels)."""

    kv_dtype: str = "float32"
    """The dtype of the pool, K/V and adapters alike (bf16 in bf16 mode, on the native CPU kernels too)."""

    weight_format: str = "float32"
    """The projections' weights: "float32", "bfloat16" or "int8"."""

    precision_reason: str = ""
    """Why the engine runs these dtypes (see docs/precision.md)."""

    bf16_gemm: str = ""
    """The native GEMM of bf16 and int8 weights, "widen" or "dot" ("": no choice, e.g. fp32 weights); why is
    in ``precision_reason``."""

    num_proposed_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens proposed by speculative decoding since the engine started, by adapter ("": the base model)."""

    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    """The proposed tokens that verification accepted, by adapter."""

    num_steps_launched_ahead: int = 0
    """Steps whose decode rows took their logits from the forward pass queued before the step before's tokens
    were read (``EngineConfig.launch_ahead``)."""

    num_passes_dropped: int = 0
    """Passes queued ahead none of whose rows the next step took (its sequences ended or were preempted, or
    verified proposals)."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed speculative tokens since the engine started (0 before any proposal)."""
        proposed = sum(self.num_proposed_tokens.values())
        return sum(self.num_accepted_tokens.values()) / proposed if proposed else 0.0
