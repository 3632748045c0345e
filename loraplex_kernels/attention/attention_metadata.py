"""Where each sequence's queries and keys live for one step: built once per step, read by every layer."""

import itertools
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
    # [num_seqs, max_num_blocks] int32, page ids; padding entries are 0. Contiguous for the torch and native
    # paths; the Triton kernels read it through both strides (a CUDA graph's is the transpose of a
    # [max_num_blocks, rows] buffer).
    block_tables: torch.Tensor
    token_to_seq: torch.Tensor  # [num_tokens] int32, the sequence of each query row
    num_decode_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_list: tuple[int, ...]  # the same as query_start_loc, on the host
    seq_lens_list: tuple[int, ...]  # the same as seq_lens, on the host
    decode_buckets: tuple["DecodeBucket", ...] = ()  # the CPU implementation's plan; empty: plan per call
    prefill_tiles: torch.Tensor | None = None  # [num_tiles, 2] int32, the Triton tiled kernel's plan; None: per call

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]


# A bucket per this many decode rows at most: fewer buckets pad more keys, more buckets cost more calls.
MAX_DECODE_BUCKETS = 4
MIN_ROWS_PER_BUCKET = 8


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows ``start:end`` attended together, their keys padded to the longest of them."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, num_blocks] int32
    mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size], 0 for a key, -inf for padding


def plan_decode_buckets(
    seq_lens: tuple[int, ...],
    block_tables: torch.Tensor,
    num_decode_seqs: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[DecodeBucket, ...]:
    """Split the decode rows into up to MAX_DECODE_BUCKETS runs of equal count.

    Rows sorted by context length (the engine sorts them) make each run's padding small; the plan is
    built once per step and serves every layer.
    """
    if not num_decode_seqs:
        return ()
    num_buckets = max(1, min(MAX_DECODE_BUCKETS, num_decode_seqs // MIN_ROWS_PER_BUCKET))
    bounds = [round(i * num_decode_seqs / num_buckets) for i in range(num_buckets + 1)]
    buckets = []
    for start, end in itertools.pairwise(bounds):
        lens = torch.tensor(seq_lens[start:end], device=block_tables.device)  # [rows]
        num_blocks = -(-int(lens.max()) // block_size)
        key_pos = torch.arange(num_blocks * block_size, device=block_tables.device)  # [keys]
        padding = key_pos[None, :] >= lens[:, None]  # [rows, keys]
        mask = torch.zeros(padding.shape, dtype=dtype, device=block_tables.device).masked_fill_(
            padding, float("-inf")
        )  # [rows, keys]
        buckets.append(
            DecodeBucket(start, end, block_tables[start:end, :num_blocks].contiguous(), mask[:, None, None, :])
        )
    return tuple(buckets)
