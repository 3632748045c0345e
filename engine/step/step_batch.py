"""Per-step metadata: which token goes where, built once per step and passed to every layer."""

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from engine.adapters.lora_batch import LoraStep, LoraStepMemo, build_lora_step
from engine.config import ModelConfig
from engine.memory.host_to_device import move_to_device
from engine.memory.page_pool import PagePool
from engine.sampling.grammar_mask import num_bitmask_words
from engine.scheduling.scheduler import ScheduledSeq
from engine.scheduling.sequence import Sequence, block_id_array
from engine.speculative.verification import DraftPosition, draft_positions
from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata, plan_decode_buckets
from loraplex_kernels.attention.paged_prefill_attention import plan_prefill_tiles
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.host_tensor import host_tensor

HOST = torch.device("cpu")  # where a step's batch is built, before it moves (or a CUDA graph takes it)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The flattened tokens of one step, decode rows first, and what to do with their outputs."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, page * block_size + offset
    attention: PagedAttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled + num_scored] int64: sampled rows, then prompt rows to score
    sampled_seqs: tuple[Sequence | DraftPosition, ...]  # in the order of the first num_sampled logits_indices;
    # a speculating sequence has k + 1 rows, one per position it verifies
    lora: LoraStep | None  # None when no token of the step uses an adapter
    scored: tuple[tuple[Sequence, int], ...] = ()  # prompt logprobs: (sequence, its rows), in the order of the rest
    scored_token_ids: torch.Tensor | None = None  # [num_scored] int64, the prompt token each scored row predicts

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _row_order(item: ScheduledSeq, group_adapters: bool) -> tuple[bool, str, int]:
    """Decode rows first. The torch attention wants them shortest context first (its buckets then pad little);
    the other backends take them by adapter, so each adapter's decode rows are one SGMV segment (a step of
    256 rows over 16 adapters has 16 segments, not up to 256, and its tables are built in as many passes)."""
    adapter = item.seq.adapter
    key = adapter.digest if group_adapters and adapter is not None else ""
    return item.num_new_tokens != 1, key, item.seq.num_computed_tokens


def build_step_batch(
    scheduled: tuple[ScheduledSeq, ...],
    pool: PagePool,
    model: ModelConfig,
    device: torch.device,
    backend: KernelBackend = KernelBackend.TORCH,
    lora_memo: LoraStepMemo | None = None,
    ahead: bool = False,
) -> StepBatch:
    """Flatten the scheduled chunks; sequences decoding one token come first (the CPU attention batches them).

    ``lora_memo``: the engine's, so that a step with the same adapter runs as the last reuses its LoRA tables.

    ``ahead``: every item is one decode row at the position just past its sequence's tokens, whose token is being
    sampled (engine/step/launch_ahead.py): its input id is 0 here, and the caller puts the sampled token there on
    the device.

    A sequence verifying proposed tokens is a small chunk: its last token and the proposal, every row sampled.

    The torch attention gets its decode buckets planned here, once for every layer; the native and the
    Triton attention need only the int32 tensors.
    """
    block_size = pool.block_size
    items = sorted(scheduled, key=partial(_row_order, group_adapters=backend is not KernelBackend.TORCH))
    num_decode = sum(item.num_new_tokens == 1 for item in items)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Sequence | DraftPosition] = []
    scored_rows: list[int] = []
    scored_token_ids: list[int] = []
    scored: list[tuple[Sequence, int]] = []
    for item in items:
        seq = item.seq
        start = seq.num_tokens if ahead else seq.num_computed_tokens
        end = start + item.num_new_tokens
        draft = item.draft_token_ids
        blocks = seq.block_ids
        if end - start == 1:  # a decode row, most of a step's: no slice, range or generator to build
            input_ids.append(0 if ahead else seq.token_ids[start])
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(seq.token_ids[start:end] if not draft else seq.token_ids[start:] + list(draft))
            positions.extend(range(start, end))
            slots.extend(blocks[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
        query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if draft:
            logits_indices.extend(range(query_start_loc[-2], query_start_loc[-1]))
            sampled.extend(draft_positions(seq, draft, num_bitmask_words(model.vocab_size)))
        elif ahead or end == len(seq.token_ids):  # the chunk reaches the sequence's end (ScheduledSeq.samples)
            logits_indices.append(query_start_loc[-1] - 1)
            sampled.append(seq)
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            # The row at position p scores prompt token p + 1; the ones already scored are not asked again.
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                row0 = query_start_loc[-2] + first - start
                scored_rows.extend(range(row0, row0 + last - first))
                scored_token_ids.extend(seq.prompt_token_ids[first + 1 : last + 1])
                scored.append((seq, last - first))
    max_blocks = max(len(item.seq.block_ids) for item in items)
    table = block_id_array()  # [num_seqs * max_blocks], each row padded with page 0: copies of C arrays
    padding = block_id_array((0,)) * max_blocks
    for item in items:
        table += item.seq.block_ids
        table += padding[: max_blocks - len(item.seq.block_ids)]
    query_lens = [item.num_new_tokens for item in items]
    num_tokens = query_start_loc[-1]
    # On the host: the step moves to the device in one copy.
    attention = PagedAttentionMetadata(
        query_start_loc=host_tensor(query_start_loc, torch.int32),  # [num_seqs + 1]
        seq_lens=host_tensor(seq_lens, torch.int32),  # [num_seqs]
        block_tables=torch.frombuffer(table, dtype=torch.int32).view(len(items), max_blocks),  # [num_seqs, blocks]
        token_to_seq=torch.arange(len(items), dtype=torch.int32)
        if num_tokens == len(items)
        else torch.repeat_interleave(
            torch.arange(len(items), dtype=torch.int32), host_tensor(query_lens), output_size=num_tokens
        ),  # [num_tokens]
        num_decode_seqs=num_decode,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_list=tuple(query_start_loc),
        seq_lens_list=tuple(seq_lens),
    )
    if backend is KernelBackend.TORCH:
        attention = dataclasses.replace(
            attention,
            decode_buckets=plan_decode_buckets(
                attention.seq_lens_list, attention.block_tables, num_decode, block_size, pool.storage.dtype
            ),
        )
    elif backend is KernelBackend.TRITON:
        # The tiled prefill kernel's tiles, planned once for every layer and moved in the step's one copy.
        group = model.num_heads // model.num_kv_heads
        tiles = plan_prefill_tiles(attention.query_start_loc_list, group, torch.device("cpu"))  # [num_tiles, 2]
        attention = dataclasses.replace(attention, prefill_tiles=tiles)
    runs = [(item.num_new_tokens, item.seq.adapter) for item in items]
    batch = StepBatch(
        input_ids=host_tensor(input_ids),  # [num_tokens]
        positions=host_tensor(positions),  # [num_tokens]
        slot_mapping=host_tensor(slots),  # [num_tokens]
        attention=attention,
        logits_indices=host_tensor(logits_indices + scored_rows),  # [num_sampled + num_scored]
        sampled_seqs=tuple(sampled),
        lora=(lora_memo.build if lora_memo is not None else build_lora_step)(runs, model, pool.storage, backend),
        scored=tuple(scored),
        scored_token_ids=host_tensor(scored_token_ids) if scored else None,  # [num_scored]
    )
    return move_to_device(batch, device)  # every tensor above in one copy (engine/memory/host_to_device.py)
