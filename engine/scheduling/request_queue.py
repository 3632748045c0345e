"""The waiting queue's policy: the order of admission, whom to preempt, what each tenant was served.

The scheduler decides how many tokens run in a step; the queue decides whose. Two policies share this
interface: :class:`FifoQueue` (first come, first served) and ``engine.scheduling.fair_queue.FairQueue`` (per-tenant
virtual token counters).
"""

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.scheduling.sequence import Sequence, SequenceStatus


class RequestQueue(Protocol):
    """What the scheduler asks of a waiting-queue policy; it never sees tensors either."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, in no promised order."""
        ...

    def push(self, seq: Sequence) -> None:
        """A new request arrives."""
        ...

    def push_front(self, seq: Sequence) -> None:
        """A running sequence was preempted; it goes back first in its line."""
        ...

    def candidates(self, held_back: frozenset[str] = frozenset()) -> Iterator[Sequence]:
        """Waiting sequences in the order they should be admitted, none of the ``held_back`` tenants'.

        Ranks may change after each admission.
        """
        ...

    def admit(self, seq: Sequence) -> None:
        """``seq`` leaves the line and starts running."""
        ...

    def finish(self, seq: Sequence) -> None:
        """``seq`` (waiting or running) ended, done or aborted; called before its status changes."""
        ...

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """This step serves ``seq`` that many prompt tokens computed for the first time and tokens generated."""
        ...

    def page_victim(self, candidates: list[Sequence]) -> Sequence:
        """Which of ``candidates`` (running, in admission order) to preempt when pages run out."""
        ...

    def fairness_victim(self, running: list[Sequence], max_num_seqs: int) -> Sequence | None:
        """A running sequence to preempt now so another tenant gets its due, or None."""
        ...

    def set_weight(self, tenant: str, weight: float) -> None: ...

    def counters(self) -> dict[str, float]:
        """Per tenant, the policy's measure of service so far (empty when the policy keeps none)."""
        ...


class FifoQueue:
    """First come, first served, whoever the tenant; a preempted sequence goes back to the front."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def candidates(self, held_back: frozenset[str] = frozenset()) -> Iterator[Sequence]:
        return iter([seq for seq in self._items if seq.tenant not in held_back])

    def admit(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:
            self._items.remove(seq)

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """FIFO keeps no account of service."""

    def page_victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]

    def fairness_victim(self, running: list[Sequence], max_num_seqs: int) -> Sequence | None:
        return None

    def set_weight(self, tenant: str, weight: float) -> None:
        """FIFO ignores weights."""

    def counters(self) -> dict[str, float]:
        return {}
