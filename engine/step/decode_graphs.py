"""CUDA graphs of decode steps: a step of decode rows replays the graph of its bucket.

A decode step launches every layer's kernels one by one from Python, and at small models or large batches
the GPU waits on those launches. A CUDA graph records the launches of one forward pass once and replays
them in one call. A graph fixes its inputs' addresses and shapes and every host-side value its launches
read, so each bucket of batch sizes (``GRAPH_BUCKETS`` up to ``max_num_seqs``) has its graph, and steps with
adapters one per bucket and :class:`~engine.step.graph_lora.LoraCapacity` (their SGMV tables padded to fixed
shapes, engine/step/graph_lora.py). A graph reads views of persistent input buffers, which each step writes
on the host and moves to the device in one copy (:class:`~engine.memory.device_mirror.DeviceMirror`). The
block table is stored by column ([max_blocks, max_num_seqs], the attention kernels read it through both
strides), last: a step moves the columns its longest row uses, for every row, and nothing past them.

- the step's rows first; the bucket's other rows are padding: token 0 at position 0, one key, reading and
  writing a scratch page of the pool that no sequence holds (``OwnerKind.SCRATCH``), so no real row's K/V is
  touched and every row's arithmetic stays its own;
- the attention's host-side lengths are the longest context a row may have (``max_model_len``): they size
  only the split axis of the Triton row kernel's grid, whose programs past a row's length exit at once.

Steps a graph cannot take run eagerly: prefill chunks, speculative rows, prompt logprobs, more rows than
``max_num_seqs``, adapters on a backend other than the Triton kernels. With ``capture=False`` the padded step
runs eagerly over the same buffers, which is how a CPU (Triton's interpreter) checks everything but the
capture itself (tests/engine/test_decode_graphs.py).
"""

import logging
from dataclasses import dataclass

import torch

from engine.adapters.adapter_layout import row_alignment
from engine.adapters.lora_batch import LoraStep
from engine.memory.device_mirror import DeviceMirror
from engine.memory.host_to_device import move_to_device
from engine.memory.page_pool import OwnerKind, PagePool
from engine.modeling.model import LlamaModel
from engine.step.graph_lora import GraphLoraTables, LoraCapacity
from engine.step.step_batch import StepBatch
from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.sgmv.sgmv_shrink import pool_holds_rows

logger = logging.getLogger(__name__)

# Batch sizes with a graph of their own; a step pads up to the next. Small steps pad at most one row in two,
# larger ones at most 15 rows (vLLM captures 1, 2, 4 and then every multiple of 8).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, *range(32, 4097, 16))


def bucket_rows(num_rows: int, max_rows: int) -> int:
    """The bucket a step of ``num_rows`` rows pads to (at most ``max_rows``, itself a bucket then)."""
    return min(next((rows for rows in GRAPH_BUCKETS if rows >= num_rows), max_rows), max_rows)


GraphKey = tuple[int, LoraCapacity | None]  # a bucket's rows, and what its adapter tables hold (None: no adapter)


@dataclass(slots=True)
class _Recorded:
    graph: "torch.cuda.CUDAGraph | None"  # None: run eagerly (capture off)
    logits: torch.Tensor | None  # [rows, vocab] fp32, the graph's output buffer
    lora: GraphLoraTables | None  # the graph's adapter tables, None for steps without adapters


class DecodeGraphs:
    """One CUDA graph per bucket (and adapter capacity) of decode-only steps, captured on its first step."""

    def __init__(self, model: LlamaModel, pool: PagePool, max_num_seqs: int, max_model_len: int, capture: bool):
        device = pool.storage.device
        self._model = model
        self._pool = pool
        self._capture = capture
        self._max_rows = max_num_seqs
        self._max_model_len = max_model_len
        self._max_blocks = -(-max_model_len // pool.block_size)
        # Taken now, while the pool is empty: a step under memory pressure must not find it missing.
        [self._scratch_page] = pool.allocate(1, owner=OwnerKind.SCRATCH)
        self._recorded: dict[GraphKey, _Recorded] = {}
        self._failed = False  # a capture raised: every step runs eagerly from then on
        self._mempool = None  # the graphs' shared memory pool, made with the first capture
        rows = max_num_seqs
        self._inputs = DeviceMirror(
            {
                "input_ids": ((rows,), torch.int64),
                "positions": ((rows,), torch.int64),
                "slot_mapping": ((rows,), torch.int64),
                "seq_lens": ((rows,), torch.int32),
                "block_columns": ((self._max_blocks, rows), torch.int32),  # last: see the module docstring
            },
            device,
        )
        self._row_ids = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [max_rows + 1]
        self._logits_rows = torch.arange(rows, dtype=torch.int64, device=device)  # [max_rows]

    @property
    def keys(self) -> tuple[GraphKey, ...]:
        """The (bucket, adapter capacity) pairs that ran a step so far, each with its graph when capturing."""
        return tuple(self._recorded)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets that ran a step so far."""
        return tuple(sorted({rows for rows, _ in self._recorded}))

    @property
    def num_graphs(self) -> int:
        return sum(recorded.graph is not None for recorded in self._recorded.values())

    def fits(self, batch: StepBatch) -> bool:
        """Whether a graph can take ``batch`` (built on the host): decode rows only, each sampled once, no prompt
        scored, adapters only on the Triton kernels and with every row they name inside the pool."""
        num_rows = batch.num_tokens
        return (
            not self._failed
            and not batch.scored
            and 0 < num_rows <= self._max_rows
            and batch.attention.num_decode_seqs == num_rows == len(batch.sampled_seqs)
            and batch.attention.block_tables.shape[1] <= self._max_blocks
            and (batch.lora is None or self._lora_fits(batch.lora))
        )

    def _lora_fits(self, lora: LoraStep) -> bool:
        """The Triton kernels' tables, whose rows at the last layer end inside the pool (the check a kernel
        launch makes on the step's own tables; a graph's launches see only the padded ones), each row at a
        multiple of the alignment the graphs' kernels were compiled for."""
        storage = self._pool.storage
        last_layer = (storage.shape[1] - 1) * lora.page_elems
        row_align = row_alignment(lora.page_elems)
        return lora.backend is KernelBackend.TRITON and all(
            pool_holds_rows(storage, group.meta, last_layer) and group.meta.row_align % row_align == 0
            for group in lora.groups.values()
        )

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The logits of ``batch``'s rows, [num_rows, vocab] fp32, from its bucket's graph (recorded if new).

        ``batch`` is the step built on the host: its values go to the graph's buffers in one copy, and its adapter
        tables in another when they are not the ones the graph holds already. Its input ids may be on the device
        (a step launched ahead of the host reading the tokens it takes): they are copied there, after the upload.
        """
        num_rows = batch.num_tokens
        rows = bucket_rows(num_rows, self._max_rows)
        key = (rows, None if batch.lora is None else LoraCapacity.of(batch.lora))
        recorded = self._recorded.get(key)
        if recorded is None:
            try:
                recorded = self._record(key, batch.lora)
            except Exception:  # a graph is an optimisation: the step, and every later one, runs without
                logger.exception("capturing the CUDA graph of %d rows failed: decode steps run without graphs", rows)
                self._failed = True
                return self._model.forward(move_to_device(batch, self._pool.storage.device), self._pool)
        self._load(batch, rows)
        if recorded.lora is not None:
            recorded.lora.load(batch.lora)
        if recorded.graph is None:
            return self._model.forward(self._padded_batch(rows, recorded.lora), self._pool)[:num_rows]
        recorded.graph.replay()
        return recorded.logits[:num_rows]

    def _load(self, batch: StepBatch, rows: int) -> None:
        """The step's rows into the buffers, then the bucket's padding rows after them."""
        num_rows = batch.num_tokens
        meta = batch.attention
        host = self._inputs.host
        on_host = batch.input_ids.device.type == "cpu"
        if on_host:
            host["input_ids"][:num_rows].copy_(batch.input_ids)
        host["positions"][:num_rows].copy_(batch.positions)
        host["slot_mapping"][:num_rows].copy_(batch.slot_mapping)
        host["seq_lens"][:num_rows].copy_(meta.seq_lens)
        num_blocks = meta.block_tables.shape[1]
        host["block_columns"][:num_blocks, :num_rows].copy_(meta.block_tables.t())
        self._pad(num_rows, rows)
        self._inputs.upload(self._inputs.end_of("block_columns", max(num_blocks, 1) * self._max_rows))
        if not on_host:  # tokens sampled by the step before, still on the device (a step launched ahead)
            self._inputs.device["input_ids"][:num_rows].copy_(batch.input_ids)

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` of the host buffers: token 0 at position 0 of the scratch page, attending to that
        one key."""
        if start == end:
            return
        page = self._scratch_page
        host = self._inputs.host
        host["input_ids"][start:end] = 0
        host["positions"][start:end] = 0
        host["slot_mapping"][start:end] = page * self._pool.block_size
        host["seq_lens"][start:end] = 1
        host["block_columns"][0, start:end] = page

    def _padded_batch(self, rows: int, lora: GraphLoraTables | None) -> StepBatch:
        """A batch of the buffers' first ``rows`` rows; its host-side values are the same for every step."""
        device = self._inputs.device
        attention = PagedAttentionMetadata(
            query_start_loc=self._row_ids[: rows + 1],  # [rows + 1]: one query row a sequence
            seq_lens=device["seq_lens"][:rows],  # [rows]
            block_tables=device["block_columns"].t()[:rows],  # [rows, max_blocks], strides (1, max_rows)
            token_to_seq=self._row_ids[:rows],  # [rows]
            num_decode_seqs=rows,
            max_query_len=1,
            max_seq_len=self._max_model_len,
            query_start_loc_list=tuple(range(rows + 1)),
            seq_lens_list=(self._max_model_len,) * rows,  # the longest a row may be: sizes the split axis
        )
        return StepBatch(
            input_ids=device["input_ids"][:rows],
            positions=device["positions"][:rows],
            slot_mapping=device["slot_mapping"][:rows],
            attention=attention,
            logits_indices=self._logits_rows[:rows],
            sampled_seqs=(),
            lora=None if lora is None else lora.step,
        )

    def _record(self, key: GraphKey, lora: LoraStep | None) -> _Recorded:
        """The key's graph: a run outside the capture compiles its kernels, then the capture over padding rows
        that read no adapter row."""
        rows, capacity = key
        tables = None if capacity is None else GraphLoraTables(capacity, lora, rows, self._pool.storage.device)
        if not self._capture:
            recorded = self._recorded[key] = _Recorded(None, None, tables)
            return recorded
        self._pad(0, rows)  # every row padding while recording: only the scratch page is written
        self._inputs.upload()
        batch = self._padded_batch(rows, tables)
        device = self._pool.storage.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._model.forward(batch, self._pool)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (an adapter's upload) go on during the capture.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits = self._model.forward(batch, self._pool)  # [rows, vocab]
        logger.info("captured the CUDA graph of decode steps of %d rows (adapters: %s)", rows, capacity)
        recorded = self._recorded[key] = _Recorded(graph, logits, tables)
        return recorded
