"""The sampler's per-step input: every sampled row's rules as tensors, built once per step.

Each optional part (penalties, logit_bias, min_tokens, grammars, the top-k/top-p/min-p cuts, logprobs) is None or
empty when no row of the step asks for it, so a step whose requests ask for none of them pays nothing.
"""

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.memory.host_to_device import move_to_device
from engine.sampling.grammar_mask import GrammarMask, build_grammar_mask
from engine.sampling.penalty_counts import PenaltyCounts
from engine.scheduling.sequence import Sequence
from loraplex_kernels.host_tensor import host_tensor

if TYPE_CHECKING:
    from engine.speculative.verification import DraftPosition


@dataclass(frozen=True, slots=True)
class Penalties:
    """Presence, frequency and repetition penalties, at the (row, token) pairs they touch and nowhere else.

    A penalty changes only the logits of tokens a sequence has seen, so it is applied to those entries
    (a few hundred a row) rather than to whole rows of the vocabulary.
    """

    flat_index: torch.Tensor  # [num_entries] int64, row * vocab + token: each (row, token) pair once
    offsets: torch.Tensor  # [num_entries] fp32, frequency_penalty * output count + presence_penalty (0: prompt only)
    repetition: torch.Tensor | None  # [num_entries] fp32, the row's repetition_penalty; None when every row's is 1
    vocab_size: int  # the logits' row width flat_index was computed for


@dataclass(frozen=True, slots=True)
class SparseLogits:
    """(row, token) pairs with a value each: logit_bias entries, or tokens min_tokens forbids (value -inf)."""

    rows: torch.Tensor  # [num_entries] int64
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor  # [num_entries] fp32


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    seqs: tuple[Sequence, ...]  # one per sampled row (a forking prompt's row appears once per choice)
    all_greedy: bool
    temperature: torch.Tensor | None  # [num_rows, 1] fp32; 1 for greedy rows; None when all are greedy
    top_k: torch.Tensor | None  # [num_rows] int64, vocab for rows without; None when no row cuts
    top_p: torch.Tensor | None  # [num_rows, 1] fp32, 1 for rows without
    min_p: torch.Tensor | None  # [num_rows, 1] fp32, 0 for rows without
    seeded_rows: tuple[int, ...]  # rows sampled with their own generator
    penalties: Penalties | None
    logit_bias: SparseLogits | None
    banned: SparseLogits | None  # min_tokens not reached: end-of-sequence and stop token ids
    grammar: GrammarMask | None  # structured output: the tokens each constrained row's grammar allows next
    logprob_rows: tuple[int, ...]  # rows whose token's logprob is returned
    num_top_logprobs: tuple[int, ...]  # per logprob row, alternatives asked for
    max_top_k: int = 0  # the largest of top_k, known on the host (reading it from the device would wait for it)
    # The same rows as tensors, moved with the rest: a Python list indexing a device tensor is a blocking copy.
    logprob_index: torch.Tensor | None = None  # [num_logprob_rows] int64; None when no row asks
    greedy_rows: torch.Tensor | None = None  # [num_greedy] int64, the greedy rows of a step that samples others


def build_sampling_batch(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    """The step's sampling rules for ``seqs``, built on the host and moved to ``device`` in one copy."""
    return move_to_device(_build(seqs, vocab_size, torch.device("cpu")), device)


def _build(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    params = [seq.params for seq in seqs]
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)  # [num_rows, 1]

    temperature = top_k = top_p = min_p = None
    max_top_k = 0
    if not all_greedy:
        temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)])
        if any(p.top_k and not g for g, p in zip(greedy, params, strict=True)):
            top_k_values = [p.top_k or vocab_size for p in params]
            top_k = torch.tensor(top_k_values, device=device)  # [num_rows]
            max_top_k = max(top_k_values)
        if any(p.top_p < 1.0 for p in params):
            top_p = column([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            min_p = column([p.min_p for p in params])
    logprob_rows = tuple(row for row, p in enumerate(params) if p.logprobs is not None)
    greedy_rows = [row for row, g in enumerate(greedy) if g]
    return SamplingBatch(
        seqs=tuple(seqs),
        all_greedy=all_greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeded_rows=tuple(row for row, seq in enumerate(seqs) if seq.generator is not None and not greedy[row]),
        penalties=_penalties(seqs, vocab_size, device),
        logit_bias=_logit_bias(seqs, device),
        banned=_banned(seqs, device),
        grammar=build_grammar_mask(seqs, vocab_size, device),
        logprob_rows=logprob_rows,
        num_top_logprobs=tuple(params[row].logprobs for row in logprob_rows),
        max_top_k=max_top_k,
        logprob_index=host_tensor(logprob_rows) if logprob_rows else None,
        greedy_rows=host_tensor(greedy_rows) if greedy_rows and not all_greedy else None,
    )


def _penalties(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> Penalties | None:
    entries = [(row, _penalty_counts(seq)) for row, seq in enumerate(seqs) if seq.params.has_penalties]
    if not any(counts.token_ids for _, counts in entries):
        return None
    sizes = np.fromiter((len(counts.token_ids) for _, counts in entries), dtype=np.int64, count=len(entries))
    # The rows' entries one after the other, joined as bytes: concatenating the arrays one by one is ~25x slower.
    token_ids = np.frombuffer(bytearray().join([counts.token_ids for _, counts in entries]), dtype=np.int64)
    offsets = bytearray().join([counts.offsets for _, counts in entries])  # [num_entries] fp32
    row_starts = np.array([row * vocab_size for row, _ in entries], dtype=np.int64)  # [num_penalised_rows]
    repetition = [seqs[row].params.repetition_penalty for row, _ in entries]  # [num_penalised_rows]
    return Penalties(
        flat_index=torch.from_numpy(np.repeat(row_starts, sizes) + token_ids).to(device),
        offsets=torch.frombuffer(offsets, dtype=torch.float32).to(device),
        repetition=None
        if all(r == 1.0 for r in repetition)
        else torch.from_numpy(np.repeat(np.array(repetition, dtype=np.float32), sizes)).to(device),
        vocab_size=vocab_size,
    )


def _penalty_counts(seq: "Sequence | DraftPosition") -> PenaltyCounts:
    """The row's penalty entries: its sequence's counts brought up to date, and for a speculating row's position
    the proposed tokens before it counted too."""
    own = seq if isinstance(seq, Sequence) else seq.seq
    if own.penalty_counts is None:
        own.penalty_counts = PenaltyCounts(own.prompt_token_ids, own.params)
    entries = own.penalty_counts.catch_up(own.token_ids)
    return entries if own is seq else entries.with_tokens(seq.draft[: seq.offset])


def _logit_bias(seqs: SequenceOf[Sequence], device: torch.device) -> SparseLogits | None:
    entries = [(row, token, bias) for row, seq in enumerate(seqs) for token, bias in seq.params.logit_bias]
    return _sparse(entries, device)


def _banned(seqs: SequenceOf[Sequence], device: torch.device) -> SparseLogits | None:
    entries = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            continue
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(seq.eos_token_ids))
        entries += [(row, token, float("-inf")) for token in sorted(ends)]
    return _sparse(entries, device)


def _sparse(entries: list[tuple[int, int, float]], device: torch.device) -> SparseLogits | None:
    if not entries:
        return None
    rows, token_ids, values = zip(*entries, strict=True)
    return SparseLogits(
        rows=torch.tensor(rows, device=device),  # [num_entries]
        token_ids=torch.tensor(token_ids, device=device),  # [num_entries]
        values=torch.tensor(values, dtype=torch.float32, device=device),  # [num_entries]
    )
