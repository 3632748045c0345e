"""A snapshot of a growing token list that costs nothing to take: an output's tokens so far."""

import itertools
from collections.abc import Iterator, Sequence
from typing import overload


class TokenView(Sequence[int]):
    """Items ``start:end`` of a list that is only ever appended to (a sequence's token ids), read-only.

    Every row of every step hands out an output with its choice's tokens so far. A copy would cost each step
    time in proportion to the output's length, and garbage the collector then walks element by element; the
    view holds the list and two bounds, so tokens appended later do not show through. It compares equal to a
    list or tuple of the same ids, concatenates with them into a list, and pickles as a list.
    """

    __slots__ = ("_end", "_start", "_tokens")

    def __init__(self, tokens: list[int], start: int, end: int) -> None:
        if not 0 <= start <= end <= len(tokens):
            raise ValueError(f"a view of items {start}:{end} of a list of {len(tokens)}")
        self._tokens = tokens
        self._start = start
        self._end = end

    def __len__(self) -> int:
        return self._end - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:  # the common case, without a copy of the whole view
                return self._tokens[self._start + start : self._start + max(start, stop)]
            return self._tokens[self._start : self._end][index]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"token index {index} out of range for {len(self)} tokens")
        return self._tokens[self._start + position]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._end)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are not hashable

    def __add__(self, other: Sequence[int]) -> list[int]:
        return [*self, *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self]

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[type[list], tuple[list[int]]]:
        return list, (list(self),)
