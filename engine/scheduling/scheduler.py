"""Which sequences run in the next step, and how many of their tokens."""

from dataclasses import dataclass

from engine.adapters.adapter_cache import AdapterCache
from engine.memory.kv_cache_manager import KVCacheManager
from engine.scheduling.request_queue import RequestQueue
from engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculative.speculation import Speculator


@dataclass(
    slots=True
)  # made for every row of every step: not frozen (see engine/output/outputs.py); treat as read-only
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # rows in the step, proposed tokens included
    draft_token_ids: tuple[int, ...] = ()  # proposed tokens after the sequence's last, verified in this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens, so the step samples a token."""
        num_real = self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.num_computed_tokens + num_real == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[str, ...]
    num_batched_tokens: int


class Scheduler:
    """One idea: every step has a token budget, shared by decode tokens and prefill chunks.

    Running sequences go first, in admission order: each decodes one token, or takes the next chunk
    of its prompt as far as the budget allows (chunked prefill, so a long prompt never stalls the
    others). What is left of the budget admits waiting sequences in the queue's order, each only when
    its adapter is resident (or can be loaded now) and the pool has pages for its first chunk (after
    prefix-cache hits); a sequence whose adapter cannot be loaded yet is passed over, so it never holds
    up requests for other adapters. When a running sequence needs a page and none is left, a sequence
    not yet scheduled in this step is preempted: its pages are freed, its adapter reference dropped,
    and it will be recomputed from its tokens later. The scheduler never touches tensors.

    Whose tokens run is the queue's business (``engine.scheduling.request_queue``): the order of admission, which
    sequence gives way when pages run out, and, before anything else in a step, which running sequence
    gives up its slot so another tenant gets its due (the fair policy; FIFO never asks). Every chunk
    scheduled is reported to the queue as it is scheduled, so it can account for each tenant's service.

    Speculative decoding (``engine.speculative.speculation``) comes last: the room the step has left goes to proposed
    tokens of decoding sequences, verified as extra rows; their slots come only from free pages (a
    proposal never preempts anyone) and are given back for the tokens the step rejects.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        adapters: AdapterCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        queue: RequestQueue,
        speculator: Speculator | None = None,
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission = queue
        """The admission policy: the waiting sequences, in the order the queue admits them (FIFO or fair)."""
        self.running: list[Sequence] = []
        self.speculator = speculator

    def add(self, seq: Sequence) -> None:
        self.admission.push(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.admission) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        gave_way = self._preempt_for_fairness()
        preempted = [seq.request_id for seq in gave_way]
        index = 0
        while index < len(self.running) and budget:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.admission.page_victim(self.running[index:])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                self._serve(scheduled, seq, num_new)
                budget -= num_new
                index += 1
        if len(preempted) == len(gave_way):  # pages were not short
            # Tenants that just gave slots away get none back in this step: they go to the others.
            budget = self._admit(budget, scheduled, frozenset(seq.tenant for seq in gave_way))
        if self.speculator is not None:
            budget = self._propose(scheduled, budget)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.max_num_batched_tokens - budget)

    def _preempt_for_fairness(self) -> list[Sequence]:
        victims = []
        while (victim := self.admission.fairness_victim(self.running, self.max_num_seqs)) is not None:
            self._preempt(victim)
            victims.append(victim)
        return victims

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], held_back: frozenset[str]) -> int:
        num_slots = sum(_num_slots(seq) for seq in self.running)
        for seq in self.admission.candidates(held_back):
            if not budget or num_slots + _num_slots(seq) > self.max_num_seqs:
                break  # a request of n choices waits for n slots, so it is never starved by smaller ones
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
            self.admission.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_slots += _num_slots(seq)
            self._serve(scheduled, seq, num_new)
            budget -= num_new
        return budget

    def _propose(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Add proposed tokens to decoding sequences' rows in the room the step has left; the budget left after."""
        num_rows = self.max_num_batched_tokens - budget
        num_room = min(budget, self.speculator.max_step_tokens - num_rows)
        if num_room <= 0:
            return budget
        decoding = [item.seq for item in scheduled if item.num_new_tokens == 1 and item.samples]
        drafts = self.speculator.drafts(decoding, num_room)
        for index, item in enumerate(scheduled):
            draft = drafts.get(item.seq)
            if draft is None or item.num_new_tokens != 1:
                continue
            if not self.kv.allocate_slots(item.seq, 1 + len(draft)):
                continue
            scheduled[index] = ScheduledSeq(item.seq, 1 + len(draft), draft)
            budget -= len(draft)
        return budget

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run ``children`` (choices forked from ``parent``, sharing its blocks) right after it, each on its own."""
        position = self.running.index(parent) + 1
        for child in children:
            self.admission.push(child)
            self.admission.admit(child)
            if child.adapter is not None:
                child.holds_adapter = self.adapters.acquire(child.adapter)  # resident: its parent holds it
                if not child.holds_adapter:
                    raise AssertionError(f"adapter of {child.request_id} not resident while its parent runs")
            child.status = SequenceStatus.RUNNING
            self.admission.charge(child, 0, 1)
        self.running[position:position] = children

    def _serve(self, scheduled: list[ScheduledSeq], seq: Sequence, num_new: int) -> None:
        """Schedule the next ``num_new`` tokens of ``seq`` and tell the queue what its tenant gets."""
        item = ScheduledSeq(seq, num_new)
        scheduled.append(item)
        if seq.num_computed_tokens >= seq.num_prompt_tokens_charged == seq.num_prompt_tokens:  # decoding
            self.admission.charge(seq, 0, int(item.samples))
            return
        prompt_end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        num_prompt = max(0, prompt_end - max(seq.num_computed_tokens, seq.num_prompt_tokens_charged))
        seq.num_prompt_tokens_charged = max(seq.num_prompt_tokens_charged, prompt_end)
        self.admission.charge(seq, num_prompt, int(item.samples))

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.holds_adapter:
            self.adapters.release(seq.adapter)
            seq.holds_adapter = False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        self._release_adapter(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.admission.push_front(seq)

    def update(self, output: SchedulerOutput) -> None:
        """Advance the computed counts of the step's sequences and register their full blocks.

        Proposed tokens are not counted: :meth:`verified` counts those the step accepted.
        """
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            self.kv.register_full_blocks(item.seq)

    def verified(self, seq: Sequence, num_accepted: int) -> None:
        """Count ``seq``'s accepted proposed tokens (appended by now) as computed; free the rejected ones' blocks."""
        seq.num_computed_tokens += num_accepted
        self.admission.charge(seq, 0, num_accepted)  # the tenant is served every token it gets, not one per step
        self.kv.rollback_slots(seq)
        self.kv.register_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out (done or aborted) and free its pages."""
        self.admission.finish(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.kv.free(seq)
        self._release_adapter(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason


def _num_slots(seq: Sequence) -> int:
    """Running slots a sequence takes: all its choices' while they are still to be forked from it."""
    return seq.params.n if seq.fork_pending else 1
