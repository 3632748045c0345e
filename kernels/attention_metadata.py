"""Where each sequence's queries and keys live for one step: built once per step, read by every layer."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """The batch's sequences for the paged attention op.

    The step's query tokens are packed sequence after sequence. Sequence ``s`` owns query rows
    ``query_start_loc[s]:query_start_loc[s + 1]``; they are the *last* ``q_len`` positions of a context
    of ``seq_lens[s]`` tokens whose K/V (this step's tokens included, already written) sit in the pages
    ``block_tables[s, :ceil(seq_lens[s] / block_size)]``. Query row ``i`` of sequence ``s`` sits at
    position ``seq_lens[s] - (query_start_loc[s + 1] - i)`` and attends causally to keys ``0..position``.

    The first ``num_decode_seqs`` sequences have exactly one query row each (decode steps); the
    builder orders them first so the CPU implementation can batch them without looking.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query rows
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, page ids; padding entries are 0
    token_to_seq: torch.Tensor  # [num_tokens] int32, the sequence of each query row
    num_decode_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_list: tuple[int, ...]  # the same as query_start_loc, on the host
    seq_lens_list: tuple[int, ...]  # the same as seq_lens, on the host

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]
