"""How often a sequence generated each token its penalties touch, counted a token at a time."""

from array import array
from collections.abc import Iterable, Sequence

from engine.sampling.sampling_params import SamplingParams


class PenaltyCounts:
    """A sequence's penalty entries: each distinct output token, and with a repetition penalty every prompt token
    too, with what its frequency and presence penalties take off its logit, in C arrays a step copies as they are.

    ``catch_up`` counts the tokens appended to the sequence since its last call, so a step pays for its new
    tokens, not for the whole output again.
    """

    __slots__ = ("_counts", "_frequency", "_index", "_num_counted", "_presence", "offsets", "token_ids")

    def __init__(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.token_ids = array("q")  # [num_entries] int64, each token once
        # [num_entries] fp32: frequency_penalty * count + presence_penalty for a generated token, 0 for a prompt
        # token not generated; computed from the exact count each time, never accumulated
        self.offsets = array("f")
        self._counts: list[int] = []  # [num_entries], each token's output count
        self._index: dict[int, int] = {}  # token -> its entry
        self._frequency, self._presence = params.frequency_penalty, params.presence_penalty
        self._num_counted = len(prompt_token_ids)  # tokens of the sequence counted so far (the prompt is not output)
        if params.repetition_penalty != 1.0:
            for token_id in dict.fromkeys(prompt_token_ids):
                self._index[token_id] = len(self.token_ids)
                self.token_ids.append(token_id)
                self.offsets.append(0.0)
                self._counts.append(0)

    def catch_up(self, token_ids: list[int]) -> "PenaltyCounts":
        """Count the sequence's tokens (prompt then output, ``token_ids``) past the ones counted before."""
        self.count(token_ids[self._num_counted :])  # a slice: islice would walk the counted tokens to skip them
        self._num_counted = len(token_ids)
        return self

    def count(self, token_ids: Iterable[int]) -> None:
        """One more generation of each of ``token_ids``."""
        frequency, presence = self._frequency, self._presence
        for token_id in token_ids:
            entry = self._index.get(token_id)
            if entry is None:
                self._index[token_id] = len(self.token_ids)
                self.token_ids.append(token_id)
                self.offsets.append(frequency + presence)
                self._counts.append(1)
            else:
                count = self._counts[entry] = self._counts[entry] + 1
                self.offsets[entry] = frequency * count + presence

    def with_tokens(self, token_ids: Iterable[int]) -> "PenaltyCounts":
        """A copy that also counts ``token_ids`` (a speculating row's proposed tokens before it)."""
        copy = PenaltyCounts.__new__(PenaltyCounts)
        copy.token_ids = array("q", self.token_ids)
        copy.offsets = array("f", self.offsets)
        copy._counts = list(self._counts)
        copy._index = dict(self._index)
        copy._frequency, copy._presence = self._frequency, self._presence
        copy._num_counted = self._num_counted
        copy.count(token_ids)
        return copy
