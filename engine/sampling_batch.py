"""The sampler's per-step input: every sampled row's rules as tensors, built once per step.

Each optional part (penalties, logit_bias, min_tokens, the top-k/top-p/min-p cuts, logprobs) is None or
empty when no row of the step asks for it, so a step whose requests ask for none of them pays nothing.
"""

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Penalties:
    """Presence, frequency and repetition penalties for the rows in ``rows``."""

    rows: torch.Tensor  # [num_rows] int64, indices into the step's sampled rows
    presence: torch.Tensor  # [num_rows, 1] fp32
    frequency: torch.Tensor  # [num_rows, 1] fp32
    output_counts: torch.Tensor  # [num_rows, vocab] fp32, how often each token was generated so far
    repetition: torch.Tensor | None  # [num_rows, 1] fp32; None when every row's is 1
    seen: torch.Tensor | None  # [num_rows, vocab] bool, tokens of the prompt or the output (with repetition)


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
    logprob_rows: tuple[int, ...]  # rows whose token's logprob is returned
    num_top_logprobs: tuple[int, ...]  # per logprob row, alternatives asked for


def build_sampling_batch(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
    params = [seq.params for seq in seqs]
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)  # [num_rows, 1]

    temperature = top_k = top_p = min_p = None
    if not all_greedy:
        temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)])
        if any(p.top_k and not g for g, p in zip(greedy, params, strict=True)):
            top_k = torch.tensor([p.top_k or vocab_size for p in params], device=device)  # [num_rows]
        if any(p.top_p < 1.0 for p in params):
            top_p = column([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            min_p = column([p.min_p for p in params])
    logprob_rows = tuple(row for row, p in enumerate(params) if p.logprobs is not None)
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
        logprob_rows=logprob_rows,
        num_top_logprobs=tuple(params[row].logprobs for row in logprob_rows),
    )


def _penalties(seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device) -> Penalties | None:
    rows = [row for row, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return None
    chosen = [seqs[row] for row in rows]
    outputs = [seq.output_token_ids for seq in chosen]
    counts = _scatter_counts(outputs, vocab_size, device)  # [num_rows, vocab]
    repetition = seen = None
    if any(seq.params.repetition_penalty != 1.0 for seq in chosen):
        repetition = torch.tensor([seq.params.repetition_penalty for seq in chosen], device=device).view(-1, 1)
        seen = _scatter_counts([seq.token_ids for seq in chosen], vocab_size, device) > 0  # [num_rows, vocab]
    return Penalties(
        rows=torch.tensor(rows, device=device),  # [num_rows]
        presence=torch.tensor([seq.params.presence_penalty for seq in chosen], device=device).view(-1, 1),
        frequency=torch.tensor([seq.params.frequency_penalty for seq in chosen], device=device).view(-1, 1),
        output_counts=counts,
        repetition=repetition,
        seen=seen,
    )


def _scatter_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: [num_lists, vocab] fp32."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)  # [num_lists, vocab]
    flat = [token for tokens in token_lists for token in tokens]
    if flat:
        lengths = torch.tensor([len(tokens) for tokens in token_lists])  # [num_lists]
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths).to(device)  # [num_flat]
        ids = torch.tensor(flat, device=device)  # [num_flat]
        counts.index_put_((rows, ids), torch.ones(len(flat), device=device), accumulate=True)
    return counts


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
