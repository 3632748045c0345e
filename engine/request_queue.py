"""The order in which waiting sequences are admitted (policy lives here, not in the scheduler)."""

from collections import deque

from engine.sequence import Sequence


class FifoQueue:
    """First come, first served; a preempted sequence goes back to the front."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)
