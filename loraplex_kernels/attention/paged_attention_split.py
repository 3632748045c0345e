"""Split-K (flash-decoding) for the row kernel of paged attention: the split plan, its scratch and the combine kernel.

A row of the row kernel whose context holds more than ``keys_per_split`` keys is attended by several
programs, one per chunk of ``keys_per_split`` consecutive keys (chunk ``i`` holds keys
``i * keys_per_split`` up to the row's position, at most ``keys_per_split`` of them), so a step of few rows
with long contexts still spreads over the GPU. Each program leaves its chunk's running max (log2 units),
sum of exp2 and unnormalised accumulator in the fp32 ``SplitScratch``; the combine kernel below rescales
chunk ``i`` by ``exp2(m_i - m_max)``, adds the chunks in order and writes the row's output. A row of
``keys_per_split`` keys or fewer is one chunk: the row kernel writes its output directly and the combine
kernel leaves it alone.

The chunks of a row depend only on its own position, never on the other rows of the step (see
``loraplex_kernels.attention.paged_attention``).
"""

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.attention.paged_prefill_attention import MIN_TILED_ROWS
from loraplex_kernels.triton_launch import AOT_ATTENTION_SHAPE, TritonLaunch, make_launch, triton_type

# Keys per chunk of a long row. A SmolLM2 context of 8192 tokens is 16 chunks, a 32k one 64, so eight
# decode rows fill an H200's 132 SMs several times over with their 3 kv heads. Shorter chunks would add
# scratch traffic and combine work; this is the row kernel's 16 key tiles of 32 keys. Not tuned on a GPU.
KEYS_PER_SPLIT = 512
_NUM_WARPS = 4

# The stride parameters of the scratch that the row kernel writes and the combine kernel reads (each ``i32``).
SPLIT_STRIDE_ARGS = (
    "stride_split_token",
    "stride_split_split",
    "stride_acc_token",
    "stride_acc_split",
    "stride_acc_head",
)

# The scratch strides that follow the step's longest row. Triton compiles a variant per int argument equal
# to 1 or divisible by 16; these are left generic, so the kernels that read them are one compiled kernel
# whatever the batch and a row's arithmetic cannot depend on its neighbours.
BATCH_STRIDE_ARGS = ("stride_split_token", "stride_acc_token")

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def num_splits(num_keys: int, keys_per_split: int) -> int:
    """Chunks of a row that attends to ``num_keys`` keys (its position + 1): its own length decides alone."""
    return -(-num_keys // keys_per_split)


def max_row_splits(meta: PagedAttentionMetadata, keys_per_split: int) -> int:
    """The split axis of the row kernel's grid: the most chunks a row of a segment shorter than MIN_TILED_ROWS needs.

    Reads only the host's ``query_start_loc_list`` and ``seq_lens_list``; a segment's last row attends to
    all ``seq_len`` keys, so it needs the segment's most chunks. 1 when no row is split.
    """
    segments = itertools.pairwise(meta.query_start_loc_list)
    return max(
        (
            num_splits(seq_len, keys_per_split)
            for seq_len, (start, end) in zip(meta.seq_lens_list, segments, strict=True)
            if end - start < MIN_TILED_ROWS
        ),
        default=1,
    )


@dataclass(frozen=True, slots=True)
class SplitScratch:
    """Every chunk's partial result in fp32, at [query row, chunk, query head]; rows of one chunk leave it unused."""

    running_max: torch.Tensor  # [num_tokens, max_splits, num_heads] fp32, log2 units
    exp_sum: torch.Tensor  # [num_tokens, max_splits, num_heads] fp32, sum of exp2(score - running_max)
    acc: torch.Tensor  # [num_tokens, max_splits, num_heads, head_dim] fp32, unnormalised

    @classmethod
    def allocate(
        cls, num_tokens: int, max_splits: int, num_heads: int, head_dim: int, device: torch.device
    ) -> "SplitScratch":
        """Scratch for ``max_splits`` chunks per row; empty when ``max_splits`` is 1 (no row is split)."""
        rows = num_tokens if max_splits > 1 else 0
        stats_shape = (rows, max_splits, num_heads)
        return cls(
            running_max=torch.empty(stats_shape, dtype=torch.float32, device=device),  # [rows, splits, heads]
            exp_sum=torch.empty(stats_shape, dtype=torch.float32, device=device),  # [rows, splits, heads]
            acc=torch.empty(
                (*stats_shape, head_dim), dtype=torch.float32, device=device
            ),  # [rows, splits, heads, head_dim]
        )

    def strides(self) -> tuple[int, ...]:
        """The values of SPLIT_STRIDE_ARGS, in order (``running_max`` and ``exp_sum`` share their strides)."""
        return (
            self.running_max.stride(0),
            self.running_max.stride(1),
            self.acc.stride(0),
            self.acc.stride(1),
            self.acc.stride(2),
        )


@triton.jit(do_not_specialize=BATCH_STRIDE_ARGS)
def _paged_attention_combine_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    split_max_ptr,  # [num_tokens, max_splits, num_heads] fp32, heads contiguous
    split_sum_ptr,  # [num_tokens, max_splits, num_heads] fp32, strided as split_max
    split_acc_ptr,  # [num_tokens, max_splits, num_heads, head_dim] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    token_to_seq_ptr,  # [num_tokens] int32
    stride_out_token,
    stride_out_head,
    stride_split_token,
    stride_split_split,
    stride_acc_token,
    stride_acc_split,
    stride_acc_head,
    min_tiled_rows,  # rows of segments at least this long are the tiled kernel's: their programs exit at once
    group: tl.constexpr,  # query heads per kv head
    head_dim: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # group rounded up to a power of two
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two
    KEYS_PER_SPLIT: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = tl.load(token_to_seq_ptr + token)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - (q_end - token)  # this row attends to keys 0..position
    row_splits = position // KEYS_PER_SPLIT + 1
    # A row of one chunk was written by the row kernel, a row of a long segment by the tiled kernel.
    if (q_end - q_start < min_tiled_rows) & (row_splits > 1):
        g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
        d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
        g_mask = g < group  # [GROUP_PAD]
        gd_mask = g_mask[:, None] & (d < head_dim)[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
        heads = kv_head * group + g  # [GROUP_PAD]

        stats_row = token.to(tl.int64) * stride_split_token + heads  # [GROUP_PAD]
        acc_offs = heads[:, None] * stride_acc_head + d[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
        acc_row = split_acc_ptr + token.to(tl.int64) * stride_acc_token
        # Padding heads read max 0 and sum 1, so their sums stay positive; they are never stored.
        m_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # [GROUP_PAD]
        for split in range(row_splits):
            m_i = tl.load(split_max_ptr + stats_row + split * stride_split_split, mask=g_mask, other=0.0)
            m_max = tl.maximum(m_max, m_i)  # [GROUP_PAD]

        denom = tl.zeros([GROUP_PAD], tl.float32)  # [GROUP_PAD]
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # [GROUP_PAD, HEAD_DIM_PAD]
        for split in range(row_splits):
            stats_offs = stats_row + split * stride_split_split  # [GROUP_PAD]
            m_i = tl.load(split_max_ptr + stats_offs, mask=g_mask, other=0.0)  # [GROUP_PAD]
            sum_i = tl.load(split_sum_ptr + stats_offs, mask=g_mask, other=1.0)  # [GROUP_PAD]
            acc_i = tl.load(
                acc_row + split * stride_acc_split + acc_offs, mask=gd_mask, other=0.0
            )  # [GROUP_PAD, HEAD_DIM_PAD]
            rescale = tl.exp2(m_i - m_max)  # [GROUP_PAD]
            denom += sum_i * rescale  # [GROUP_PAD]
            acc += acc_i * rescale[:, None]  # [GROUP_PAD, HEAD_DIM_PAD]

        out = acc / denom[:, None]  # [GROUP_PAD, HEAD_DIM_PAD]
        out_offs = heads[:, None] * stride_out_head + d[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
        out_row = out_ptr + token.to(tl.int64) * stride_out_token
        tl.store(out_row + out_offs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@functools.cache  # a pure function of its arguments: built once per model shape and dtype, not per layer
def combine_launch(dtype: torch.dtype, group: int, head_dim: int, keys_per_split: int) -> TritonLaunch:
    """The combine kernel's constexprs, ``num_warps`` and signature, as ``combine_splits`` launches it."""
    arg_types = {
        "out_ptr": f"*{triton_type(dtype)}",
        **dict.fromkeys(("split_max_ptr", "split_sum_ptr", "split_acc_ptr"), "*fp32"),
        **dict.fromkeys(("query_start_loc_ptr", "seq_lens_ptr", "token_to_seq_ptr"), "*i32"),
        **dict.fromkeys(("stride_out_token", "stride_out_head", *SPLIT_STRIDE_ARGS, "min_tiled_rows"), "i32"),
    }
    constexprs = {
        "group": group,
        "head_dim": head_dim,
        "GROUP_PAD": triton.next_power_of_2(group),
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "KEYS_PER_SPLIT": keys_per_split,
    }
    return make_launch(_paged_attention_combine_kernel, dtype, arg_types, constexprs, _NUM_WARPS)


def triton_launches() -> tuple[TritonLaunch, ...]:
    """The combine kernel at SmolLM2-135M's shape (``AOT_ATTENTION_SHAPE``) in every dtype the launcher accepts."""
    shape = AOT_ATTENTION_SHAPE
    return tuple(combine_launch(dtype, shape.group, shape.head_dim, KEYS_PER_SPLIT) for dtype in _SUPPORTED_DTYPES)


def combine_splits(
    out: torch.Tensor,
    scratch: SplitScratch,
    meta: PagedAttentionMetadata,
    num_kv_heads: int,
    keys_per_split: int,
) -> None:
    """Write into ``out`` the rows of the row kernel that took more than one chunk, from their chunks in ``scratch``.

    ``out`` is [num_tokens, num_heads, head_dim], contiguous; ``scratch`` holds what the row kernel left
    for the same ``meta`` and ``keys_per_split``. Rows of one chunk and rows of segments of MIN_TILED_ROWS
    rows or more are left untouched.
    """
    num_tokens, num_heads, head_dim = out.shape
    launch = combine_launch(out.dtype, num_heads // num_kv_heads, head_dim, keys_per_split)
    # One program per (query row, kv head), as the row kernel: the group's heads share the loads of the
    # chunk's statistics, and a program's row finds its own number of chunks from its position.
    grid = (num_tokens, num_kv_heads)
    _paged_attention_combine_kernel[grid](
        out,
        scratch.running_max,
        scratch.exp_sum,
        scratch.acc,
        meta.query_start_loc,
        meta.seq_lens,
        meta.token_to_seq,
        out.stride(0),
        out.stride(1),
        *scratch.strides(),
        MIN_TILED_ROWS,
        **launch.constexprs,
        **launch.options(),
    )
