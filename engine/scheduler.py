"""Which sequences run in the next step, and how many of their tokens."""

from dataclasses import dataclass

from engine.adapter_cache import AdapterCache
from engine.kv_cache_manager import KVCacheManager
from engine.request_queue import FifoQueue
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens, so the step samples a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[str, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """One idea: every step has a token budget, shared by decode tokens and prefill chunks.

    Running sequences go first, in admission order: each decodes one token, or takes the next chunk
    of its prompt as far as the budget allows (chunked prefill, so a long prompt never stalls the
    others). What is left of the budget admits waiting sequences in the queue's order, each only when
    its adapter is resident (or can be loaded now) and the pool has pages for its first chunk (after
    prefix-cache hits); a sequence whose adapter cannot be loaded yet is passed over, so it never holds
    up requests for other adapters. When a running sequence needs a page and none is left, the most
    recently admitted sequence is preempted: its pages are freed, its adapter reference dropped, and it
    will be recomputed from its tokens later. The scheduler never touches tensors.
    """

    def __init__(
        self, kv: KVCacheManager, adapters: AdapterCache, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = FifoQueue()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                index += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.max_num_batched_tokens - budget)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        for seq in list(self.waiting):
            if not budget or len(self.running) >= self.max_num_seqs:
                break
            if seq.adapter is not None and not seq.holds_adapter:
                if not self.adapters.acquire(seq.adapter):
                    continue  # its adapter does not fit now; others may still run
                seq.holds_adapter = True
            is_first_admission = seq.num_preemptions == 0
            num_cached = self.kv.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, num_new):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                self._release_adapter(seq)
                break
            if is_first_admission:
                seq.num_cached_tokens = num_cached
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.holds_adapter:
            self.adapters.release(seq.adapter)
            seq.holds_adapter = False

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self._release_adapter(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)

    def update(self, output: SchedulerOutput) -> None:
        """Advance the computed counts of the step's sequences and register their full blocks."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.register_full_blocks(item.seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out (done or aborted) and free its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
