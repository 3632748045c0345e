"""The next decode step's forward pass, queued on the device before the host reads the tokens it takes.

On CUDA the host and the device take turns in a step: the device runs the forward pass and draws the tokens
while the host waits, then the host reads the tokens, applies them (detokenizing, stop checks, outputs),
schedules the next step and builds its tables while the device waits. Launching ahead overlaps the two:
as soon as a step's tokens are drawn (on the device, not yet read), the forward pass of the next decode step
over the same sequences is queued behind them, its input ids those drawn tokens, gathered on the device. The
host then reads the tokens and does its work while the device runs that pass.

Nothing the scheduler decides changes. The next step is scheduled as always; each of its items that is one
decode row of a sequence the pass ran, at the position and through the page table the pass ran it with, takes
the pass's row of logits (:meth:`LaunchAhead.take`); the step's other items (a request admitted meanwhile, a
prompt's next chunk, proposals) run in a forward pass of their own, as the whole step would without the pass.
On the native CPU kernels a row is the same bits in any batch, so which pass computes it changes nothing; on
CUDA it is as between any two batchings (docs/triton-kernels.md). A pass none of whose rows the step takes is
dropped. A pass costs device time, never a result: it wrote K/V only into its sequences' own slots,
at the position past their tokens, for the very token each drew (so a step that runs the row again writes the
same), and a sequence that ended or was preempted meanwhile frees its pages only on the host: whatever the
device does with them next is queued behind the pass.

A pass is launched when every row of the step sampled one token (no proposal verified, no choice forked, no prompt
logprobs scored, whose reading would wait for the pass). With speculative decoding on, a step that verified no
proposal (the prompt lookup found none, the step had no room, or low acceptance rates paused it) is most often
followed by another; a row that does get proposals runs them in the next step's own forward pass and leaves its
row of the pass unused. A row whose drawn token is its last
by ``max_tokens`` is left out. A pass that fails to launch is logged, and no pass is launched after it (as a
failed CUDA graph capture leaves every step eager).
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
from engine.scheduling.scheduler import ScheduledSeq
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


@dataclass(frozen=True, slots=True)
class TakenRows:
    """What a step takes from the pass launched before it, and what it still runs itself."""

    seqs: tuple[Sequence, ...]  # the step's rows the pass ran, in the pass's order
    logits: torch.Tensor  # [len(seqs), vocab] fp32
    rest: tuple[ScheduledSeq, ...]  # the step's other items, for a forward pass of their own


class LaunchAhead:
    """Launches the pass after a step's draw (:meth:`launch`) and hands its logits to the next step (:meth:`take`).

    ``counts``: steps that took rows of a pass ("taken"), and passes none of whose rows the next step took
    ("dropped").
    """

    def __init__(
        self,
        *,
        forward: Callable[[StepBatch], torch.Tensor],
        kv: KVCacheManager,
        pool: PagePool,
        model_config: ModelConfig,
        kernels: KernelBackend,
        lora_memo: LoraStepMemo,
    ) -> None:
        self._forward = forward
        self._kv = kv
        self._pool = pool
        self._model_config = model_config
        self._kernels = kernels
        self._lora_memo = lora_memo
        self._pending: _Pass | None = None
        self._failed = False  # a launch raised: no pass from then on
        self.counts = {"taken": 0, "dropped": 0}

    def launch(self, rows: list[Sequence | DraftPosition], token_ids: torch.Tensor) -> None:
        """Queue the next decode pass of ``rows`` (a step's sampled rows, in the order of ``token_ids`` [num_rows],
        drawn on the device and not read yet; no choice forked from them), unless the next step cannot take it;
        a failure only skips it."""
        self._pending = None
        if self._failed or any(isinstance(row, DraftPosition) for row in rows):
            return
        try:
            self._pending = self._launch(cast("list[Sequence]", rows), token_ids)
        except Exception:  # an optimisation: the steps run as they would without it
            logger.exception("launching a decode pass ahead failed: from now on every step runs its own forward pass")
            self._failed = True

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

    def take(self, items: tuple[ScheduledSeq, ...]) -> TakenRows | None:
        """The rows of a step of ``items`` that the pass launched before it ran: each item that is one decode row
        of a sequence the pass ran, at the position and through the page table the pass ran it with. None (and the
        pass dropped) when there is no such item."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows = pending.rows
        found: list[int] = []
        rest: list[ScheduledSeq] = []
        for item in items:
            seq = item.seq
            entry = rows.get(seq)
            if (
                entry is not None
                and item.num_new_tokens == 1
                and entry[1] == seq.num_computed_tokens
                and entry[2] is seq.block_ids
            ):
                found.append(entry[0])
            else:
                rest.append(item)
        if not found:
            self.counts["dropped"] += 1
            return None
        self.counts["taken"] += 1
        if len(found) == len(pending.seqs):  # every row the pass ran: most steps
            return TakenRows(pending.seqs, pending.logits, tuple(rest))
        found.sort()
        index = host_tensor(found).to(pending.logits.device, non_blocking=True)  # [num_found]
        return TakenRows(tuple(pending.seqs[row] for row in found), pending.logits[index], tuple(rest))
