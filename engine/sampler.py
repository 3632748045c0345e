"""Next-token choice for every sampled row: greedy, temperature, top-k, top-p, per-request seeds."""

import torch

from engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: tuple[Sequence, ...]) -> list[int]:
    """One token id per row of ``logits`` [num_sampled, vocab] (fp32), following each row's params.

    Greedy rows take the argmax together. Other rows are sampled one by one with their own generator
    when they have a seed, so a seeded request draws the same tokens whatever else is in the batch.
    """
    token_ids = logits.argmax(dim=-1).tolist()  # [num_sampled]
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            continue
        scaled = logits[row] / params.temperature  # [vocab]
        if params.top_k and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = scaled.softmax(dim=-1)  # [vocab]
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        token_ids[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return token_ids


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``."""
    sorted_probs, order = probs.sort(descending=True)  # [vocab], [vocab]
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [vocab], mass ranked above each token
    outside = before >= top_p  # [vocab]
    outside[0] = False  # the likeliest token always stays, even when top_p is below fp32's least value (rounds to 0)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)  # [vocab]
