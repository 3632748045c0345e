"""How one request wants its tokens chosen and when it wants to stop."""

from dataclasses import dataclass

from engine.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules for one request (OpenAI's names where they exist)."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 picks the most likely token (greedy); higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to at least this much."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Makes a sampled (temperature > 0) request reproducible on its own, whatever runs beside it."""
    stop: tuple[str, ...] = ()
    """Strings that end the output; the text returned stops before the first of them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (besides the model's end-of-sequence tokens)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
