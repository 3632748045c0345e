"""Next-token choice for every sampled row of a step at once, and the logprobs the rows asked for.

Order, as vLLM's sampler: logit_bias and min_tokens' bans, then the repetition, frequency and presence
penalties (on the logits); greedy rows take the argmax there. Sampled rows are divided by their
temperature, cut by top-k, turned into probabilities, cut by top-p and min-p, and drawn by the
exponential race (``argmax(p / q)``, ``q ~ Exp(1)``): one draw for every row together, and a row with a
seed draws its ``q`` from its own generator, so it gets the same tokens whatever runs beside it.
Logprobs are taken from the logits as the model gave them, before any of this.
"""

from dataclasses import dataclass

import torch

from engine.logprobs import TokenLogprob, token_logprobs
from engine.sampling_batch import Penalties, SamplingBatch, SparseLogits


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where the row did not ask


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Choose one token per row of ``logits`` [num_rows, vocab] (fp32) following ``batch``."""
    raw = logits[list(batch.logprob_rows)] if batch.logprob_rows else None  # [num_logprob_rows, vocab], a copy
    logits = apply_logit_rules(logits, batch)  # [num_rows, vocab]
    chosen = logits.argmax(dim=-1)  # [num_rows]
    if not batch.all_greedy:
        sampled = _draw(logits, batch)  # [num_rows]
        greedy = torch.tensor([seq.params.greedy for seq in batch.seqs], device=logits.device)  # [num_rows]
        chosen = torch.where(greedy, chosen, sampled)  # [num_rows]
    logprobs: list[TokenLogprob | None] = [None] * len(batch.seqs)
    if raw is not None:
        rows = list(batch.logprob_rows)
        for row, entry in zip(rows, token_logprobs(raw, chosen[rows], list(batch.num_top_logprobs)), strict=True):
            logprobs[row] = entry
    return SamplerOutput(chosen.tolist(), logprobs)


def apply_logit_rules(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens' bans and the penalties; returns ``logits`` itself when no row has any."""
    if batch.logit_bias is not None:
        logits = _add_sparse(logits, batch.logit_bias)
    if batch.banned is not None:
        logits = _add_sparse(logits, batch.banned)
    if batch.penalties is not None:
        logits = _apply_penalties(logits, batch.penalties)
    return logits


def _add_sparse(logits: torch.Tensor, entries: SparseLogits) -> torch.Tensor:
    return logits.index_put((entries.rows, entries.token_ids), entries.values, accumulate=True)  # [num_rows, vocab]


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    rows = logits[penalties.rows]  # [num_penalised, vocab]
    if penalties.repetition is not None:
        repetition = penalties.repetition  # [num_penalised, 1]
        scaled = torch.where(rows > 0, rows / repetition, rows * repetition)  # [num_penalised, vocab]
        rows = torch.where(penalties.seen, scaled, rows)  # [num_penalised, vocab]
    counts = penalties.output_counts  # [num_penalised, vocab]
    rows = rows - penalties.frequency * counts - penalties.presence * (counts > 0)  # [num_penalised, vocab]
    return logits.index_copy(0, penalties.rows, rows)  # [num_rows, vocab]


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One sampled token per row (greedy rows' results are discarded by the caller): [num_rows]."""
    scaled = logits / batch.temperature  # [num_rows, vocab]
    if batch.top_k is not None:
        max_k = int(batch.top_k.max())
        top_values = scaled.topk(max_k, dim=-1).values  # [num_rows, max_k]
        kth = top_values.gather(1, (batch.top_k.clamp(max=max_k) - 1).view(-1, 1))  # [num_rows, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)  # [num_rows, vocab]
    if batch.top_p is not None:
        probs = _top_p(probs, batch.top_p)
    if batch.min_p is not None:
        floor = probs.amax(dim=-1, keepdim=True) * batch.min_p  # [num_rows, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    q = torch.empty_like(probs).exponential_()  # [num_rows, vocab]
    for row in batch.seeded_rows:  # a seed is one request's own: its draw must not depend on the batch
        own = torch.empty(q.shape[1]).exponential_(generator=batch.seqs[row].generator)  # [vocab], a CPU generator
        q[row] = own.to(q.device)
    return (probs / q).argmax(dim=-1)  # [num_rows]


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's smallest set whose probability reaches its ``top_p`` [num_rows, 1]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [num_rows, vocab] each
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [num_rows, vocab], mass ranked above each token
    outside = before >= top_p  # [num_rows, vocab]
    outside[:, 0] = False  # the likeliest token always stays, even when top_p is below fp32's least value (rounds to 0)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)  # [num_rows, vocab]
