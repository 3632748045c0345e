"""Fairness between tenants: S-LoRA's virtual token counters (VTC), with a weight per tenant."""

import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.scheduling.sequence import Sequence, SequenceStatus

# VTC's costs (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): a generated token
# costs a forward step of its own, a prompt token shares its step with the rest of its chunk.
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
SHARE_EPSILON = 1e-9  # slot shares are fractions: keeps 6 × 1/3 from counting as just under 2


@dataclass(slots=True, eq=False)
class _Tenant:
    name: str
    weight: float = 1.0
    counter: float = 0.0  # virtual tokens: the service received, divided by the weight
    line: deque[Sequence] = field(default_factory=deque)  # waiting, first come first (a preempted one in front)
    num_running: int = 0

    @property
    def is_active(self) -> bool:
        return bool(self.line) or self.num_running > 0

    def rank(self) -> tuple[float, float]:
        """Lower goes first: served least, then holding the fewest running slots for its weight."""
        return self.counter, self.num_running / self.weight


class FairQueue:
    """One line per tenant; the next sequence admitted comes from the tenant served least so far.

    Counters: every tenant has a virtual token counter. Each step adds what it serves the tenant,
    prompt tokens computed × 1 + tokens generated × 2, divided by the tenant's weight, so a tenant of
    weight 2 reaches the same counter with twice the service. Prompt tokens recomputed after a
    preemption, or served by the prefix cache, are not service.

    Admission: the waiting tenant with the lowest counter goes next (ties: the fewest running slots per
    weight, then the older head), first come first served within a tenant. Admitting a sequence charges
    its first chunk at once, so ranks change during one step's admissions.

    No banked credit: a tenant that becomes active again (it had nothing waiting or running) has its
    counter lifted to the lowest counter of the active tenants, or, when none is, to the counter of the
    last tenant that went idle. Time spent idle is not saved up against the others.

    A full batch (the policy's choice): counters decide who gets the next free slot, but a tenant that
    holds every slot with long requests keeps them until they end, and a newcomer would wait for that.
    So a tenant with waiting sequences and at least one slot below its share (``max_num_seqs`` × its
    weight / the active tenants' total weight) takes a slot from a tenant at least one slot above its
    share whose counter is not lower: that tenant's most recently admitted sequence is preempted by
    recompute (its full blocks stay in the prefix cache). Guards against thrashing: a slot only moves
    from a tenant at least one above its share to one at least one below, so no such preemption undoes
    another while the shares stand (slots still flow back through ordinary admissions as requests end:
    about one preemption per request of the claiming tenant); the tenant that gave slots away gets none
    back in the same step; and a sequence claims a slot only if its adapter is resident (or it has none),
    since one whose adapter cannot load yet would leave the slot empty. When pages run out, the victim
    is the most recently admitted sequence of the running tenant with the highest counter, not just the
    latest admission.
    """

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._active: dict[str, _Tenant] = {}  # tenants with waiting or running sequences
        self._idle_floor = 0.0  # the counter of the last tenant that went idle
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        return itertools.chain.from_iterable(tenant.line for tenant in self._active.values())

    def push(self, seq: Sequence) -> None:
        tenant = self._tenant(seq.tenant)
        if not tenant.is_active:
            floor = min((other.counter for other in self._active.values()), default=self._idle_floor)
            tenant.counter = max(tenant.counter, floor)
            self._active[tenant.name] = tenant
        tenant.line.append(seq)
        self._num_waiting += 1

    def push_front(self, seq: Sequence) -> None:
        tenant = self._tenants[seq.tenant]
        tenant.num_running -= 1
        tenant.line.appendleft(seq)
        self._num_waiting += 1

    def candidates(self, held_back: frozenset[str] = frozenset()) -> Iterator[Sequence]:
        num_passed: dict[str, int] = {}  # per tenant, sequences at the head of its line passed over this round
        while True:
            best: _Tenant | None = None
            for tenant in self._active.values():
                skip = num_passed.get(tenant.name, 0)
                if len(tenant.line) <= skip or tenant.name in held_back:
                    continue
                if best is None or self._key(tenant, skip) < self._key(best, num_passed.get(best.name, 0)):
                    best = tenant
            if best is None:
                return
            skip = num_passed.get(best.name, 0)
            seq = best.line[skip]
            yield seq
            if seq.status is SequenceStatus.WAITING:  # not admitted: look past it next time
                num_passed[best.name] = skip + 1

    def admit(self, seq: Sequence) -> None:
        tenant = self._tenants[seq.tenant]
        tenant.line.remove(seq)
        tenant.num_running += 1
        self._num_waiting -= 1

    def finish(self, seq: Sequence) -> None:
        tenant = self._tenants[seq.tenant]
        if seq.status is SequenceStatus.WAITING:
            tenant.line.remove(seq)
            self._num_waiting -= 1
        elif seq.status is SequenceStatus.RUNNING:
            tenant.num_running -= 1
        if not tenant.is_active:
            del self._active[tenant.name]
            self._idle_floor = tenant.counter

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        tenant = self._tenants[seq.tenant]
        cost = num_prompt_tokens * PROMPT_TOKEN_COST + num_output_tokens * OUTPUT_TOKEN_COST
        tenant.counter += cost / tenant.weight

    def page_victim(self, candidates: list[Sequence]) -> Sequence:
        latest_first = list(reversed(candidates))
        names = dict.fromkeys(seq.tenant for seq in latest_first)
        giver = max(names, key=lambda name: self._tenants[name].rank())  # ties: the latest admitted tenant
        return next(seq for seq in latest_first if seq.tenant == giver)

    def fairness_victim(self, running: list[Sequence], max_num_seqs: int) -> Sequence | None:
        total_weight = sum(tenant.weight for tenant in self._active.values())

        def slack(tenant: _Tenant) -> float:
            """Slots below its share (negative: above it)."""
            return max_num_seqs * tenant.weight / total_weight - tenant.num_running + SHARE_EPSILON

        givers = [tenant for tenant in self._active.values() if slack(tenant) <= -1 + 2 * SHARE_EPSILON]
        if not givers:
            return None
        giver = max(givers, key=_Tenant.rank)
        num_claimed = sum(
            _num_ready(tenant.line, math.floor(slack(tenant)))
            for tenant in self._active.values()
            if tenant.line and slack(tenant) >= 1 and tenant.counter <= giver.counter
        )
        if num_claimed <= max_num_seqs - len(running):
            return None
        return next(seq for seq in reversed(running) if seq.tenant == giver.name)

    def set_weight(self, tenant: str, weight: float) -> None:
        self._tenant(tenant).weight = weight

    def counters(self) -> dict[str, float]:
        return {name: tenant.counter for name, tenant in self._tenants.items()}

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name)
        return tenant

    @staticmethod
    def _key(tenant: _Tenant, skip: int) -> tuple[float, float, float]:
        return (*tenant.rank(), tenant.line[skip].arrival_time)


def _num_ready(line: deque[Sequence], limit: int) -> int:
    """Of the first ``limit`` in line, those that could start once they have a slot: no adapter, or a resident one."""
    return sum(1 for seq in itertools.islice(line, limit) if seq.adapter is None or seq.adapter.is_resident)
