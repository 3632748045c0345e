"""Verifying proposed tokens: each of a sequence's k + 1 rows is sampled as its own position; the agreeing run is kept.

A proposal is a point mass, so the standard speculative-sampling rule (accept the proposed token ``d``
with probability ``min(1, p(d) / q(d)) = p(d)``, else draw from the residual ``p`` without ``d``,
renormalised) is the same as drawing a token ``t`` from ``p`` and accepting the proposal when
``t == d``, emitting ``t`` either way. So every row is sampled by the ordinary sampler, with every rule
(temperature, penalties, logit_bias, min_tokens, the grammar mask, top-k/top-p/min-p) applied as if the
proposed tokens before it had been generated, and the output keeps the model's distribution exactly:
greedy rows accept while the proposal equals the argmax. A seeded request draws one number per emitted
token from its generator, as without speculation, so its tokens are the same with speculation or without.
"""

from dataclasses import dataclass

import torch

from engine.sampling.grammar import GrammarState
from engine.sampling.logprobs import TokenLogprob
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence


class DraftGrammar:
    """The grammar masks of one row of a speculating sequence, filled ahead (the matcher is rolled back after)."""

    def __init__(self, bitmask: torch.Tensor) -> None:
        self.bitmask = bitmask  # [ceil(vocab / 32)] int32

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.bitmask


@dataclass(slots=True, eq=False)
class DraftPosition:
    """Row ``offset`` of a speculating sequence: the sampler sees the sequence with ``draft[:offset]`` appended."""

    seq: Sequence
    draft: tuple[int, ...]
    offset: int
    grammar: DraftGrammar | None = None
    fork_pending: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + list(self.draft[: self.offset])

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.offset

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.seq.eos_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator


def draft_positions(seq: Sequence, draft: tuple[int, ...], words: int) -> list[DraftPosition]:
    """The k + 1 sampling rows of ``seq`` verifying ``draft``; a grammar's masks are filled now, ``words`` int32 wide.

    The grammar's matcher advances through the proposal to fill each row's mask and is rolled back to
    where it was; a proposed token the grammar forbids is never accepted (its row's mask excludes it), so
    the rows after it get the last legal mask, unused.
    """
    masks: list[DraftGrammar | None] = [None] * (len(draft) + 1)
    if seq.grammar is not None:
        masks = _grammar_rows(seq.grammar, draft, words)
    return [DraftPosition(seq, draft, offset, masks[offset]) for offset in range(len(draft) + 1)]


def _grammar_rows(grammar: GrammarState, draft: tuple[int, ...], words: int) -> list[DraftGrammar | None]:
    bitmask = torch.empty(len(draft) + 1, words, dtype=torch.int32)  # [k + 1, words]
    num_advanced = 0
    for offset in range(len(draft) + 1):
        grammar.fill_mask(bitmask, offset)
        if offset == len(draft) or not grammar.try_accept(draft[offset]):
            bitmask[offset + 1 :] = bitmask[offset]
            break
        num_advanced += 1
        if grammar.is_complete:  # the proposal ended the grammar: the rows after it are never used
            bitmask[offset + 1 :] = bitmask[offset]
            break
    grammar.rollback(num_advanced)
    return [DraftGrammar(bitmask[offset]) for offset in range(len(draft) + 1)]


@dataclass(
    slots=True
)  # made for every row of every step: not frozen (see engine/output/outputs.py); treat as read-only
class Verified:
    """One sequence's tokens from a step: the accepted proposal, then the model's own next token."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    num_proposed: int  # proposed tokens verified in this step (0: an ordinary row)


def accept(
    rows: list[Sequence | DraftPosition], token_ids: list[int], logprobs: list[TokenLogprob | None]
) -> list[Verified]:
    """Group the sampled rows by sequence; a speculating one keeps its rows while each sampled token is proposed."""
    out: list[Verified] = []
    row = 0
    while row < len(rows):
        entry = rows[row]
        if not isinstance(entry, DraftPosition):
            out.append(Verified(entry, [token_ids[row]], [logprobs[row]], 0))
            row += 1
            continue
        draft = entry.draft
        num_accepted = 0
        while num_accepted < len(draft) and token_ids[row + num_accepted] == draft[num_accepted]:
            num_accepted += 1
        emitted = slice(row, row + num_accepted + 1)
        out.append(Verified(entry.seq, token_ids[emitted], logprobs[emitted], len(draft)))
        row += len(draft) + 1
    return out


def rewind_generators(states: dict[int, torch.Tensor], verified: list[Verified]) -> None:
    """Leave each seeded speculating sequence's generator one draw per emitted token past its state before the step."""
    for result in verified:
        seq = result.seq
        state = states.get(id(seq))
        if state is None:
            continue
        seq.generator.set_state(state)
        for _ in result.token_ids:  # the sampler's draws for the emitted rows, one call each as it made them
            torch.rand(1, generator=seq.generator)


def generator_states(rows: list[Sequence | DraftPosition]) -> dict[int, torch.Tensor]:
    """The generator state of each seeded sampled speculating sequence before the sampler draws."""
    return {
        id(row.seq): row.seq.generator.get_state()
        for row in rows
        if isinstance(row, DraftPosition) and row.offset == 0 and row.generator is not None and not row.params.greedy
    }
