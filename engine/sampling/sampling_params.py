"""How one request wants its tokens chosen, how many choices it wants, and when each should stop."""

from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import RequestError
from engine.sampling.grammar import GrammarConstraint

MAX_LOGPROBS = 20  # OpenAI's most top_logprobs per token
MAX_LOGIT_BIAS = 300  # OpenAI's most logit_bias entries
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI bounds them
MAX_CACHE_SALT_CHARS = 256  # a tenant's id is 36; hashed once per sequence


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules for one request (OpenAI's names where they exist, vLLM's otherwise)."""

    max_tokens: int = 16
    """Most tokens to generate per choice; 0 only with ``prompt_logprobs`` (score the prompt, generate nothing)."""
    temperature: float = 1.0
    """0 picks the most likely token (greedy); higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to at least this much."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the likeliest token's; 0 keeps all."""
    seed: int | None = None
    """Makes a sampled request reproducible on its own, whatever runs beside it; choice i uses seed + i."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's definition), within [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence in the output (OpenAI's definition), within [-2, 2]."""
    repetition_penalty: float = 1.0
    """vLLM's: logits of tokens seen in the prompt or output are divided (positive) or multiplied (negative) by it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias within [-100, 100]) pairs added to the logits; a dict is accepted and sorted."""
    min_tokens: int = 0
    """End-of-sequence and ``stop_token_ids`` cannot end a choice before it has this many tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end the output; the text returned stops before the first of them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (besides the model's end-of-sequence tokens)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""
    logprobs: int | None = None
    """None: no logprobs; k: each generated token's log-probability and the k likeliest alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """None: none; k: every prompt token's log-probability (the first has none) and k alternatives (0..20)."""
    n: int = 1
    """Choices to generate from one prompt; they share the prompt's KV blocks."""
    constraint: GrammarConstraint | None = None
    """Structured output: the text must match it (JSON schema, any object, regex, choice) and ends when complete."""
    speculate: bool = True
    """Let the engine propose tokens from the text so far and verify them (when the server enables it); the
    output is the same either way, so False only trades speed for nothing, e.g. to measure."""

    cache_salt: str | None = None
    """Prefix-cache blocks are shared only among requests with the same salt (vLLM's ``cache_salt``); None
    shares with every unsalted request. The gateway salts with the tenant's id: the prompt tokens a response
    reports as cached then tell a tenant nothing about what another tenant sent."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, Mapping):
            pairs = tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items()))
            object.__setattr__(self, "logit_bias", pairs)
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise RequestError(
                f"max_tokens must be at least 1 (or 0 with prompt_logprobs, to score the prompt), got {self.max_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be within [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise RequestError(f"{name} must be within [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise RequestError(f"repetition_penalty must be within (0, 100], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if any(not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS for _, bias in self.logit_bias):
            raise RequestError("logit_bias values must be within [-100, 100]")
        if self.min_tokens < 0 or (self.max_tokens and self.min_tokens > self.max_tokens):
            raise RequestError(f"min_tokens must be within [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be within [0, {MAX_LOGPROBS}], got {value}")
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise RequestError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}")
        if self.constraint is not None and self.min_tokens:
            raise RequestError("min_tokens cannot be combined with structured output: its grammar decides the end")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token every time."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must count this request's earlier tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether anything but temperature and the top-k/top-p/min-p cuts touches the logits."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.constraint is not None
