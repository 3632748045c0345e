"""How often a sequence generated each token its penalties touch, counted a token at a time."""

import itertools
from array import array
from collections.abc import Iterable, Sequence


class PenaltyCounts:
    """A sequence's penalty entries: each distinct output token and how often it was generated, and with a
    repetition penalty every prompt token too (count 0 unless generated), in C arrays a step copies as they are.

    ``catch_up`` counts the tokens appended to the sequence since its last call, so a step pays for its new
    tokens, not for the whole output again.
    """

    __slots__ = ("_index", "_num_counted", "counts", "token_ids")

    def __init__(self, prompt_token_ids: Sequence[int], with_prompt: bool) -> None:
        self.token_ids = array("q")  # [num_entries] int64, each token once
        self.counts = array("f")  # [num_entries] fp32, its output count (exact up to 2**24)
        self._index: dict[int, int] = {}  # token -> its entry
        self._num_counted = len(prompt_token_ids)  # tokens of the sequence counted so far (the prompt is not output)
        if with_prompt:
            for token_id in dict.fromkeys(prompt_token_ids):
                self._index[token_id] = len(self.token_ids)
                self.token_ids.append(token_id)
                self.counts.append(0.0)

    def catch_up(self, token_ids: list[int]) -> "PenaltyCounts":
        """Count the sequence's tokens (prompt then output, ``token_ids``) past the ones counted before."""
        self.count(itertools.islice(token_ids, self._num_counted, None))
        self._num_counted = len(token_ids)
        return self

    def count(self, token_ids: Iterable[int]) -> None:
        """One more generation of each of ``token_ids``."""
        for token_id in token_ids:
            entry = self._index.get(token_id)
            if entry is None:
                self._index[token_id] = len(self.token_ids)
                self.token_ids.append(token_id)
                self.counts.append(1.0)
            else:
                self.counts[entry] += 1.0

    def with_tokens(self, token_ids: Iterable[int]) -> "PenaltyCounts":
        """A copy that also counts ``token_ids`` (a speculating row's proposed tokens before it)."""
        copy = PenaltyCounts((), with_prompt=False)
        copy.token_ids = array("q", self.token_ids)
        copy.counts = array("f", self.counts)
        copy._index = dict(self._index)
        copy.count(token_ids)
        return copy
