"""What one forward pass produced: sampled tokens, prompt logprobs, and the choices forked from a prompt.

The engine applies a :class:`StepResult` to its sequences after the step (``StepRunner._update``); nothing
here registers anything, so a failed step simply drops what it made.
"""

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from engine.output.detokenizer import IncrementalDetokenizer
from engine.sampling.logprobs import TokenLogprob, token_logprobs
from engine.scheduling.sequence import Sequence
from engine.speculative.verification import DraftPosition, Verified
from engine.step.step_batch import StepBatch


@dataclass(slots=True)
class StepResult:
    """What one forward pass produced, applied to the sequences by ``StepRunner._update``."""

    sampled: list[Verified] = field(default_factory=list)  # each sampled sequence's tokens (several when it speculated)
    scores: list[tuple[Sequence, list[TokenLogprob]]] = field(default_factory=list)  # prompt logprobs
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)  # choice 0, the choices it forks


def fork_choices(
    sampled: tuple[Sequence | DraftPosition, ...], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[Sequence | DraftPosition], list[tuple[Sequence, list[Sequence]]]]:
    """Each sampled row's sequence, plus new choices for the prompts that fork now (their rows repeated).

    The new choices are not registered anywhere yet (``StepRunner._update`` does it), so a failed step drops them.
    """
    rows: list[int] = []
    seqs: list[Sequence | DraftPosition] = []
    forks: list[tuple[Sequence, list[Sequence]]] = []
    for row, seq in enumerate(sampled):
        rows.append(row)
        seqs.append(seq)
        if not seq.fork_pending:
            continue
        children = [_new_choice(seq, index, tokenizer) for index in range(1, seq.params.n)]
        forks.append((seq, children))
        rows += [row] * len(children)
        seqs += children
    return rows, seqs, forks


def _new_choice(parent: Sequence, index: int, tokenizer: PreTrainedTokenizerBase) -> Sequence:
    return Sequence(
        request_id=parent.request_id,
        prompt_token_ids=parent.prompt_token_ids,
        params=parent.params,
        detokenizer=IncrementalDetokenizer(tokenizer, parent.prompt_token_ids, parent.params.stop),
        eos_token_ids=parent.eos_token_ids,
        adapter=parent.adapter,
        tenant=parent.tenant,
        arrival_time=parent.arrival_time,
        index=index,
        num_cached_tokens=parent.num_cached_tokens,  # the prompt's cache hits are every choice's
        prompt_logprobs=parent.prompt_logprobs,  # one list for every choice: the prompt is scored once
        grammar=parent.grammar.fresh() if parent.grammar is not None else None,  # forked before any output token
    )


def prompt_scores(batch: StepBatch, logits: torch.Tensor) -> list[tuple[Sequence, list[TokenLogprob]]]:
    """Each scored sequence's prompt logprobs from this step's rows of ``logits`` [num_scored, vocab]."""
    if not batch.scored:
        return []
    num_top = [seq.params.prompt_logprobs for seq, num_rows in batch.scored for _ in range(num_rows)]
    entries = token_logprobs(logits, batch.scored_token_ids, num_top)
    scores, start = [], 0
    for seq, num_rows in batch.scored:
        scores.append((seq, entries[start : start + num_rows]))
        start += num_rows
    return scores
