"""The next decode step's forward pass, queued on the device before the host reads the tokens it takes.

On CUDA the host and the device take turns in a step: the device runs the forward pass and draws the tokens
while the host waits, then the host reads the tokens, applies them (detokenizing, stop checks, outputs),
schedules the next step and builds its tables while the device waits. Launching ahead overlaps the two:
as soon as a step's tokens are drawn (on the device, not yet read), the forward pass of the next decode step
over the same sequences is queued behind them, its input ids those drawn tokens, gathered on the device. The
host then reads the tokens and does its work while the device runs that pass.

Nothing the scheduler decides changes. The next step is scheduled as always; when it is one decode row for
each of some of the sequences the pass ran, at the position the pass ran them at, its logits are the pass's
rows for them (:meth:`LaunchAhead.take`). Otherwise the pass is dropped and the step runs as usual. A dropped
pass costs device time, never a result: it wrote K/V only into its sequences' own slots, at the position past
their tokens, for the very token each drew (so a step that runs the row again writes the same), and a
sequence that ended or was preempted meanwhile frees its pages only on the host: whatever the device does
with them next is queued behind the pass.

A pass is launched only where the next step will likely be that decode step: every row of the step sampled
one token (no proposal verified, no choice forked, no logprobs, whose reading would wait for the pass), every
running sequence is among them, no waiting request can be admitted, and with speculative decoding on, the step
leaves proposals no room. A row whose drawn token is its last by ``max_tokens`` is left out. A pass that fails
to launch is logged, and no pass is launched after it (as a failed CUDA graph capture leaves every step eager).
"""

import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch

from engine.adapters.lora_batch import LoraStepMemo
from engine.config import ModelConfig
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.page_pool import PagePool
from engine.scheduling.scheduler import ScheduledSeq, Scheduler
from engine.scheduling.sequence import Sequence
from engine.speculative.verification import DraftPosition
from engine.step.step_batch import HOST, StepBatch, build_step_batch
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.host_tensor import host_tensor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pass:
    """A launched pass: its sequences in row order, and for each its row, the position the row computed and the
    page table it wrote through (the sequence's own array: freeing its pages gives it a new one)."""

    seqs: tuple[Sequence, ...]  # [num_rows], the rows' order
    rows: dict[Sequence, tuple[int, int, "array[int]"]]  # sequence -> (its row, its position, its block_ids)
    logits: torch.Tensor  # [num_rows, vocab] fp32, queued on the device


class LaunchAhead:
    """Launches the pass after a step's draw (:meth:`launch`) and hands its logits to the next step (:meth:`take`).

    ``counts``: steps that took a pass's logits ("taken"), and passes dropped because the step was another
    ("dropped").
    """

    def __init__(
        self,
        *,
        forward: Callable[[StepBatch], torch.Tensor],
        scheduler: Scheduler,
        kv: KVCacheManager,
        pool: PagePool,
        model_config: ModelConfig,
        kernels: KernelBackend,
        lora_memo: LoraStepMemo,
    ) -> None:
        self._forward = forward
        self._scheduler = scheduler
        self._kv = kv
        self._pool = pool
        self._model_config = model_config
        self._kernels = kernels
        self._lora_memo = lora_memo
        self._pending: _Pass | None = None
        self._failed = False  # a launch raised: no pass from then on
        self.counts = {"taken": 0, "dropped": 0}

    def launch(
        self, rows: list[Sequence | DraftPosition], token_ids: torch.Tensor, has_forks: bool, has_logprobs: bool
    ) -> None:
        """Queue the next decode pass of ``rows`` (a step's sampled rows, in the order of ``token_ids`` [num_rows],
        drawn on the device and not read yet), where that step is likely next; a failure only skips it."""
        self._pending = None
        seqs = None if has_forks or has_logprobs or self._failed else self._likely_next(rows)
        if seqs is None:
            return
        try:
            self._pending = self._launch(seqs, token_ids)
        except Exception:  # an optimisation: the steps run as they would without it
            logger.exception("launching a decode pass ahead failed: from now on every step runs its own forward pass")
            self._failed = True

    def _likely_next(self, rows: list[Sequence | DraftPosition]) -> list[Sequence] | None:
        """``rows``, when the next step is likely one decode row for each of them; else None."""
        scheduler = self._scheduler
        seqs = [row for row in rows if not isinstance(row, DraftPosition)]
        if not seqs or len(seqs) != len(rows) or len(seqs) != len(scheduler.running):
            return None  # a proposal was verified, or a running sequence did not sample (its prompt goes on)
        speculator = scheduler.speculator
        if speculator is not None and len(seqs) < speculator.max_step_tokens:
            return None  # the next step has room for proposals, which are rows of their own
        if len(scheduler.admission) and len(seqs) < scheduler.max_num_seqs:
            return None  # a waiting request would be admitted with its prompt
        return seqs if set(seqs) == set(scheduler.running) else None

    def _launch(self, rows: list[Sequence], token_ids: torch.Tensor) -> _Pass | None:
        block_size = self._pool.block_size
        items = []
        for seq in rows:
            num_tokens = len(seq.token_ids)
            if num_tokens - len(seq.prompt_token_ids) + 1 >= seq.params.max_tokens:
                continue  # the drawn token is its last
            # Its slots through the drawn token's position (computed counts move only when the step is applied): most
            # rows have it in their last page already, which the step wrote into, so it is theirs alone.
            if num_tokens < len(seq.block_ids) * block_size or self._kv.allocate_slots(
                seq, num_tokens + 1 - seq.num_computed_tokens
            ):
                items.append(ScheduledSeq(seq, 1))
        if not items:
            return None
        self._pool.copy_pages(self._kv.take_copies())
        batch = build_step_batch(
            tuple(items), self._pool, self._model_config, HOST, self._kernels, self._lora_memo, ahead=True
        )
        seqs = cast("tuple[Sequence, ...]", batch.sampled_seqs)  # decode rows: sequences, no proposal's positions
        row_of = {seq: row for row, seq in enumerate(rows)}
        order = host_tensor([row_of[seq] for seq in seqs])  # [num_ahead]
        inputs = token_ids[order.to(token_ids.device, non_blocking=True)]  # [num_ahead], on the device
        logits = self._forward(replace(batch, input_ids=inputs))  # [num_ahead, vocab]
        return _Pass(seqs, {seq: (row, len(seq.token_ids), seq.block_ids) for row, seq in enumerate(seqs)}, logits)

    def drop(self) -> None:
        """Forget the pass launched last: the tokens it took may not be the ones the step applies (the step failed
        after the pass was launched and runs again row by row)."""
        self._pending = None

    def take(self, items: tuple[ScheduledSeq, ...]) -> tuple[tuple[Sequence, ...], torch.Tensor] | None:
        """The sampled rows and logits [num_items, vocab] of a step of ``items``, from the pass launched before it,
        when each item is one decode row that the pass ran at its position through the page table the sequence
        holds; else None (and the pass is dropped). The rows come in the pass's order."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows = pending.rows
        found = []
        for item in items:
            seq = item.seq
            entry = rows.get(seq)
            if (
                entry is None
                or item.num_new_tokens != 1
                or entry[1] != seq.num_computed_tokens
                or entry[2] is not seq.block_ids
            ):
                self.counts["dropped"] += 1
                return None
            found.append(entry[0])
        self.counts["taken"] += 1
        if len(found) == len(pending.seqs):  # every row the pass ran: most steps
            return pending.seqs, pending.logits
        found.sort()
        index = host_tensor(found).to(pending.logits.device, non_blocking=True)  # [num_items]
        return tuple(pending.seqs[row] for row in found), pending.logits[index]
