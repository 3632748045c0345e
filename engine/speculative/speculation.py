"""When a step carries proposals, for which sequences, and how long: speculation pays only where the step is not full.

On a CPU (and a GPU at small batch) a decode step costs about the same for 1 row as for a few dozen: the
time goes to reading the weights, not to the rows. Proposed tokens ride in those free rows; once the step
has ``max_step_tokens`` rows (decode rows, prefill chunks, earlier proposals), another row costs its full
share, and a proposal that is only partly accepted makes the step slower than it saves. So per step:

- proposals only fill the room left under ``max_step_tokens`` and the token budget, after every decode
  row and prefill chunk was scheduled (speculation never delays another request's tokens);
- sequences with the best recent acceptance rate go first, and each proposes at most ``k`` tokens scaled
  by that rate (a sequence whose proposals keep failing proposes fewer);
- a sequence whose rate fell under ``MIN_ACCEPTANCE_RATE`` stops proposing and tries again every
  ``RETRY_INTERVAL_STEPS`` steps (the text it is writing may start copying again).

At high concurrency the decode rows alone fill the step, no sequence proposes, and the engine runs as
without speculation.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.scheduling.sequence import Sequence
from engine.speculative.ngram_proposer import propose_ngram

RATE_WEIGHT = 0.5  # weight of the latest step in a sequence's acceptance rate (an exponential average)
MIN_ACCEPTANCE_RATE = 0.2  # below this, a proposal costs more rows than it saves tokens
RETRY_INTERVAL_STEPS = 16  # a sequence that stopped proposing tries again after this many steps


@dataclass(slots=True)
class SpeculationStats:
    """Proposed and accepted tokens, per adapter name ("" for the base model)."""

    num_proposed: dict[str, int] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)

    def record(self, adapter: str, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed[adapter] = self.num_proposed.get(adapter, 0) + num_proposed
        self.num_accepted[adapter] = self.num_accepted.get(adapter, 0) + num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens, every adapter together (0 before any proposal)."""
        proposed = sum(self.num_proposed.values())
        return sum(self.num_accepted.values()) / proposed if proposed else 0.0


class Speculator:
    """Picks each step's proposals (n-gram prompt lookup) and tracks how well each sequence's proposals do."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_step_tokens: int,
        propose: Callable[[list[int], int, int, int], list[int]] = propose_ngram,
    ) -> None:
        self.k = num_speculative_tokens
        self.propose = propose  # (token ids, min n, max n, most tokens) -> proposal; n-gram lookup
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_step_tokens = max_step_tokens
        self.stats = SpeculationStats()

    def drafts(self, decoding: list[Sequence], num_room: int) -> dict[Sequence, tuple[int, ...]]:
        """Proposals for some of ``decoding`` (sequences about to decode one token), ``num_room`` extra rows at most."""
        out: dict[Sequence, tuple[int, ...]] = {}
        ranked = sorted((seq for seq in decoding if self._may_propose(seq)), key=lambda seq: -seq.speculation_rate)
        for seq in ranked:
            if num_room <= 0:
                break
            remaining = (
                seq.params.max_tokens - seq.num_output_tokens - 1
            )  # the step emits one token beyond the proposal
            limit = min(max(1, round(self.k * seq.speculation_rate)), remaining, num_room)
            if limit <= 0:
                continue
            draft = self.propose(seq.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, limit)
            if draft:
                out[seq] = tuple(draft)
                num_room -= len(draft)
        return out

    def _may_propose(self, seq: Sequence) -> bool:
        if not seq.params.speculate or seq.fork_pending:
            return False
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            return False  # its rows still score prompt tokens
        if seq.speculation_rate >= MIN_ACCEPTANCE_RATE:
            return True
        seq.num_steps_unspeculated += 1
        if seq.num_steps_unspeculated < RETRY_INTERVAL_STEPS:
            return False
        seq.num_steps_unspeculated = 0
        seq.speculation_rate = MIN_ACCEPTANCE_RATE  # one more try at the smallest proposal
        return True

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Fold one verification into ``seq``'s acceptance rate and the per-adapter totals."""
        if not num_proposed:
            return
        rate = num_accepted / num_proposed
        seq.speculation_rate = (1 - RATE_WEIGHT) * seq.speculation_rate + RATE_WEIGHT * rate
        self.stats.record(seq.adapter.name if seq.adapter is not None else "", num_proposed, num_accepted)
