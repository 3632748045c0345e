"""Log-probabilities as the model gives them: log-softmax of the raw logits, the chosen token's and the top k."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the likeliest tokens with theirs (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """Per row of ``logits`` [num_rows, vocab] (fp32, raw): the logprob of ``token_ids`` [num_rows], and the top ones.

    ``num_top[i]`` alternatives for row i (0..20); one topk call serves every row at the largest count.
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1).tolist()  # [num_rows]
    max_top = max(num_top, default=0)
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top] each
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    ids = token_ids.tolist()
    out = []
    for row, k in enumerate(num_top):
        top = tuple(zip(top_ids[row][:k], top_values[row][:k], strict=True)) if k else ()
        out.append(TokenLogprob(ids[row], chosen[row], top))
    return out
