"""One step's token mask for its constrained rows: each row's grammar says which tokens may come next.

xgrammar writes the allowed tokens of a row as a bitmask (bit ``j`` of word ``i`` allows token
``32 * i + j``); the mask is built only when some row of the step is constrained, and touches only those
rows, so unconstrained rows and steps without constraints pay nothing.
"""

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.scheduling.sequence import Sequence

BITS_PER_WORD = 32


@dataclass(frozen=True, slots=True)
class GrammarMask:
    rows: torch.Tensor  # [num_constrained] int64, indices into the step's sampled rows
    bitmask: torch.Tensor  # [num_constrained, ceil(vocab / 32)] int32; xgrammar fills it on the host


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def build_grammar_mask(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> GrammarMask | None:
    """The allowed next tokens of every constrained row, or None when no row is constrained."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), num_bitmask_words(vocab_size), dtype=torch.int32)  # [num_constrained, words]
    for i, row in enumerate(rows):
        seqs[row].grammar.fill_mask(bitmask, i)
    return GrammarMask(torch.tensor(rows, device=device), bitmask)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab] bool from a bitmask [num_rows, words] int32: True where the token may come next."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)  # [32], where the mask is
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, words, 32]; & 1 drops the sign's extension
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [num_rows, vocab]


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """-inf at every token the rows' grammars forbid, in place; ``logits`` [num_rows, vocab] itself is returned."""
    allowed = allowed_tokens(mask.bitmask, logits.shape[1]).to(logits.device)  # [num_constrained, vocab]
    constrained = logits.index_select(0, mask.rows)  # [num_constrained, vocab], a copy
    return logits.index_copy_(0, mask.rows, constrained.masked_fill_(~allowed, float("-inf")))
