"""Log-probabilities as the model gives them: log-softmax of the raw logits, the chosen token's and the top k."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the likeliest tokens with theirs (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class LogprobTensors:
    """The rows' logprobs as tensors, on the logits' device until :meth:`to_host` (read by :func:`entries`)."""

    token_ids: torch.Tensor  # [num_rows] int64
    chosen: torch.Tensor  # [num_rows] fp32, each row's token's logprob
    top_values: torch.Tensor | None  # [num_rows, max_top] fp32, best first; None when no row asks for any
    top_ids: torch.Tensor | None  # [num_rows, max_top] int64

    def to_host(self) -> "LogprobTensors":
        """The same tensors in pinned host memory, their copies queued (non-blocking) on the current stream."""
        return LogprobTensors(
            *(_pinned_copy(tensor) for tensor in (self.token_ids, self.chosen, self.top_values, self.top_ids))
        )


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int) -> LogprobTensors:
    """Per row of ``logits`` [num_rows, vocab] (fp32, raw): the logprob of ``token_ids`` [num_rows] and the
    ``max_top`` likeliest tokens' (one topk call serves every row at the largest count), without reading them."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1)  # [num_rows]
    top_values = top_ids = None
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top] each
    return LogprobTensors(token_ids, chosen, top_values, top_ids)


def entries(tensors: LogprobTensors, num_top: list[int]) -> list[TokenLogprob]:
    """One entry per row of ``tensors`` (on the host once their copies are done), ``num_top[i]`` alternatives for
    row i (0..20)."""
    ids, chosen = tensors.token_ids.tolist(), tensors.chosen.tolist()
    top_values = tensors.top_values.tolist() if tensors.top_values is not None else None
    top_ids = tensors.top_ids.tolist() if tensors.top_ids is not None else None
    out = []
    for row, k in enumerate(num_top):
        top = tuple(zip(top_ids[row][:k], top_values[row][:k], strict=True)) if k else ()
        out.append(TokenLogprob(ids[row], chosen[row], top))
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """Per row of ``logits`` [num_rows, vocab] (fp32, raw): the logprob of ``token_ids`` [num_rows], and the top ones.

    ``num_top[i]`` alternatives for row i (0..20).
    """
    return entries(logprob_tensors(logits, token_ids, max(num_top, default=0)), num_top)


def _pinned_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
