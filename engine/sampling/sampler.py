"""Next-token choice for every sampled row of a step at once, and the logprobs the rows asked for.

Order, as vLLM's sampler: logit_bias and min_tokens' bans, then the repetition, frequency and presence
penalties (on the logits), then the grammar mask of structured output (-inf wherever a row's grammar
forbids the token); greedy rows take the argmax there. Sampled rows are divided by their
temperature, cut by top-k, turned into probabilities, cut by top-p and min-p, and drawn by inverse CDF: one uniform
number per row, and a row with a seed draws its number from its own generator, so it gets the same
tokens whatever runs beside it.
Logprobs are taken from the logits as the model gave them, before any of this.
"""

from dataclasses import dataclass

import torch

from engine.sampling.grammar_mask import apply_grammar_mask
from engine.sampling.logprobs import LogprobTensors, TokenLogprob, entries, logprob_tensors
from engine.sampling.sampling_batch import Penalties, SamplingBatch, SparseLogits
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.argmax_rows import argmax_rows


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where the row did not ask


@dataclass(frozen=True, slots=True)
class DrawnTokens:
    """A step's chosen tokens (and the logprobs asked for) on the host once ``copied`` has completed.

    Their copies from the device are queued right behind the draw, so work queued after it (the next step's
    forward pass, launched ahead) does not delay :meth:`read`: on CUDA it waits for an event recorded after the
    copies, not for the whole stream.
    """

    token_ids: torch.Tensor  # [num_rows] int64, on the logits' device
    host_token_ids: torch.Tensor  # [num_rows] int64 on the host: pinned, in flight until ``copied`` on CUDA
    logprobs: LogprobTensors | None  # the rows that asked for logprobs, on the host as the tokens are
    copied: "torch.cuda.Event | None"  # None on a CPU, where nothing is in flight
    batch: SamplingBatch

    def read(self) -> SamplerOutput:
        """The tokens (and logprobs) on the host; waits for the draw, not for anything queued after it."""
        if self.copied is not None:
            self.copied.synchronize()
        logprobs: list[TokenLogprob | None] = [None] * len(self.batch.seqs)
        if self.logprobs is not None:
            rows = self.batch.logprob_rows
            for row, entry in zip(rows, entries(self.logprobs, list(self.batch.num_top_logprobs)), strict=True):
                logprobs[row] = entry
        return SamplerOutput(self.host_token_ids.tolist(), logprobs)


@torch.inference_mode()
def sample(logits: torch.Tensor, batch: SamplingBatch, backend: KernelBackend = KernelBackend.TORCH) -> SamplerOutput:
    """One token per row of ``logits`` [num_rows, vocab] (fp32) following ``batch``; ``logits`` is overwritten.

    ``backend`` is the engine's kernel backend: its greedy choice (the native argmax on CPU).
    """
    return draw(logits, batch, backend).read()


@torch.inference_mode()
def draw(logits: torch.Tensor, batch: SamplingBatch, backend: KernelBackend = KernelBackend.TORCH) -> DrawnTokens:
    """:func:`sample` up to the copies of its results to the host, which :meth:`DrawnTokens.read` waits for."""
    index = batch.logprob_index
    raw = logits.index_select(0, index) if index is not None else None  # [num_logprob_rows, vocab], a copy
    logits = apply_logit_rules(logits, batch)  # [num_rows, vocab]
    if batch.all_greedy:
        chosen = argmax_rows(logits, backend)  # [num_rows]
    else:
        greedy_rows = batch.greedy_rows  # [num_greedy]
        greedy_ids = argmax_rows(logits.index_select(0, greedy_rows), backend) if greedy_rows is not None else None
        chosen = _draw(logits, batch)  # [num_rows]; ``logits`` is used up
        if greedy_ids is not None:
            chosen.index_copy_(0, greedy_rows, greedy_ids)
    logprobs = None
    if raw is not None:
        max_top = max(batch.num_top_logprobs)
        logprobs = logprob_tensors(raw, chosen.index_select(0, index), max_top).to_host()
    if chosen.device.type == "cpu":
        return DrawnTokens(chosen, chosen, logprobs, None, batch)
    host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)  # [num_rows]
    host.copy_(chosen, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return DrawnTokens(chosen, host, logprobs, copied, batch)


def apply_logit_rules(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens' bans, the penalties and the grammar mask, in place; ``logits`` itself is returned."""
    if batch.logit_bias is not None:
        logits = _add_sparse(logits, batch.logit_bias)
    if batch.banned is not None:
        logits = _add_sparse(logits, batch.banned)
    if batch.penalties is not None:
        logits = _apply_penalties(logits, batch.penalties)
    if batch.grammar is not None:
        logits = apply_grammar_mask(logits, batch.grammar)
    return logits


def _add_sparse(logits: torch.Tensor, entries: SparseLogits) -> torch.Tensor:
    return logits.index_put_((entries.rows, entries.token_ids), entries.values, accumulate=True)  # [num_rows, vocab]


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    if logits.shape[1] != penalties.vocab_size:  # the flat index would land in other rows' logits
        raise ValueError(f"logits are {logits.shape[1]} wide, the penalties were built for {penalties.vocab_size}")
    logits = logits.contiguous()  # [num_rows, vocab], itself unless it is a view of another layout
    flat = logits.view(-1)  # [num_rows * vocab]
    values = flat.index_select(0, penalties.flat_index)  # [num_entries]
    if penalties.repetition is not None:  # a factor of 1 leaves a value as it is
        repetition = penalties.repetition  # [num_entries]
        values = torch.where(values > 0, values / repetition, values * repetition)  # [num_entries]
    flat.index_copy_(0, penalties.flat_index, values.sub_(penalties.offsets))  # each (row, token) pair is there once
    return logits


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One sampled token per row (greedy rows' results are discarded by the caller): [num_rows].

    Inverse-CDF sampling: one uniform number per row, found in the row's cumulative probabilities. A
    seeded row takes its number from its own generator (one draw, whatever the vocabulary), the others
    from one call together; torch.multinomial and an exponential race cost far more a row
    (docs/benchmarks.md#engine-constants-and-choices).
    """
    scaled = logits.div_(batch.temperature)  # [num_rows, vocab], in place: the step's logits are not needed again
    if batch.top_k is not None:
        max_k = batch.max_top_k
        top_values = scaled.topk(max_k, dim=-1).values  # [num_rows, max_k]
        kth = top_values.gather(1, (batch.top_k.clamp(max=max_k) - 1).view(-1, 1))  # [num_rows, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)  # [num_rows, vocab]
    if batch.top_p is not None:
        probs = _top_p(probs, batch.top_p)
    if batch.min_p is not None:
        floor = probs.amax(dim=-1, keepdim=True) * batch.min_p  # [num_rows, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    uniform = torch.rand(probs.shape[0], 1)  # [num_rows, 1], on the CPU like the requests' generators
    for row in batch.seeded_rows:  # a seed is one request's own: its draw must not depend on the batch
        uniform[row] = torch.rand(1, generator=batch.seqs[row].generator)
    cdf = probs.cumsum_(dim=-1)  # [num_rows, vocab], in place
    # non_blocking: CUDA stages a pageable source before returning, so the host never waits for the device.
    targets = uniform.to(cdf.device, non_blocking=True) * cdf[:, -1:]  # [num_rows, 1], within each row's total mass
    # right=True: the first token whose cumulative mass passes the target, never one of probability 0.
    token_ids = torch.searchsorted(cdf, targets, right=True).view(-1)  # [num_rows]
    return token_ids.clamp_(max=probs.shape[1] - 1)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's smallest set whose probability reaches its ``top_p`` [num_rows, 1]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [num_rows, vocab] each
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [num_rows, vocab], mass ranked above each token
    outside = before >= top_p  # [num_rows, vocab]
    outside[:, 0] = False  # the likeliest token always stays, even when top_p is below fp32's least value (rounds to 0)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)  # [num_rows, vocab]
