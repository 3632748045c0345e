"""CUDA graphs of decode steps: a step of decode rows without adapters replays the graph of its bucket.

A decode step launches every layer's kernels one by one from Python, and at small models or large batches
the GPU waits on those launches. A CUDA graph records the launches of one forward pass once and replays
them in one call. A graph fixes its inputs' addresses and shapes and every host-side value its launches
read, so each bucket of batch sizes (``GRAPH_BUCKETS`` up to ``max_num_seqs``) has its graph, over views of
persistent input buffers that each step fills:

- the step's rows first; the bucket's other rows are padding: token 0 at position 0, one key, reading and
  writing a scratch page of the pool that no sequence holds (``OwnerKind.SCRATCH``), so no real row's K/V is
  touched and every row's arithmetic stays its own;
- the attention's host-side lengths are the longest context a row may have (``max_model_len``): they size
  only the split axis of the Triton row kernel's grid, whose programs past a row's length exit at once.

Steps a graph cannot take run eagerly: prefill chunks, speculative rows, prompt logprobs, adapters (their
tables change with the step's runs), more rows than ``max_num_seqs``. With ``capture=False`` the padded step
runs eagerly over the same buffers, which is how a CPU (Triton's interpreter) checks everything but the
capture itself (tests/engine/test_decode_graphs.py).
"""

import logging
from dataclasses import dataclass

import torch

from engine.memory.page_pool import OwnerKind, PagePool
from engine.modeling.model import LlamaModel
from engine.step.step_batch import StepBatch
from loraplex_kernels.attention.attention_metadata import PagedAttentionMetadata

logger = logging.getLogger(__name__)

# Batch sizes with a graph of their own; a step pads up to the next. Small steps pad at most one row in two,
# larger ones at most 15 rows (vLLM captures 1, 2, 4 and then every multiple of 8).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, *range(32, 4097, 16))


def bucket_rows(num_rows: int, max_rows: int) -> int:
    """The bucket a step of ``num_rows`` rows pads to (at most ``max_rows``, itself a bucket then)."""
    return min(next((rows for rows in GRAPH_BUCKETS if rows >= num_rows), max_rows), max_rows)


@dataclass(slots=True)
class _Recorded:
    graph: "torch.cuda.CUDAGraph | None"  # None: run eagerly (capture off)
    logits: torch.Tensor | None  # [rows, vocab] fp32, the graph's output buffer


class DecodeGraphs:
    """One CUDA graph per bucket of decode-only steps without adapters, captured on the bucket's first step."""

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
        self._recorded: dict[int, _Recorded] = {}
        self._failed = False  # a capture raised: every step runs eagerly from then on
        self._mempool = None  # the graphs' shared memory pool, made with the first capture
        rows = max_num_seqs
        self._input_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # [max_rows]
        self._positions = torch.zeros(rows, dtype=torch.int64, device=device)  # [max_rows]
        self._slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)  # [max_rows]
        self._seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [max_rows]
        self._block_tables = torch.zeros(rows, self._max_blocks, dtype=torch.int32, device=device)  # [rows, blocks]
        self._row_ids = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [max_rows + 1]
        self._logits_rows = torch.arange(rows, dtype=torch.int64, device=device)  # [max_rows]

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets that ran a step so far (each with its graph, when capturing)."""
        return tuple(sorted(self._recorded))

    @property
    def num_graphs(self) -> int:
        return sum(recorded.graph is not None for recorded in self._recorded.values())

    def fits(self, batch: StepBatch) -> bool:
        """Whether a graph can take ``batch``: decode rows only, each sampled once, no adapter, no prompt scored."""
        num_rows = batch.num_tokens
        return (
            not self._failed
            and batch.lora is None
            and not batch.scored
            and 0 < num_rows <= self._max_rows
            and batch.attention.num_decode_seqs == num_rows == len(batch.sampled_seqs)
            and batch.attention.block_tables.shape[1] <= self._max_blocks
        )

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The logits of ``batch``'s rows, [num_rows, vocab] fp32, from its bucket's graph (recorded if new)."""
        num_rows = batch.num_tokens
        rows = bucket_rows(num_rows, self._max_rows)
        recorded = self._recorded.get(rows)
        if recorded is None:
            try:
                recorded = self._record(rows)
            except Exception:  # a graph is an optimisation: the step, and every later one, runs without
                logger.exception("capturing the CUDA graph of %d rows failed: decode steps run without graphs", rows)
                self._failed = True
                return self._model.forward(batch, self._pool)
        self._load(batch, rows)
        if recorded.graph is None:
            return self._model.forward(self._padded_batch(rows), self._pool)[:num_rows]
        recorded.graph.replay()
        return recorded.logits[:num_rows]

    def _load(self, batch: StepBatch, rows: int) -> None:
        """The step's rows into the buffers, then the bucket's padding rows after them."""
        num_rows = batch.num_tokens
        meta = batch.attention
        self._input_ids[:num_rows].copy_(batch.input_ids)
        self._positions[:num_rows].copy_(batch.positions)
        self._slot_mapping[:num_rows].copy_(batch.slot_mapping)
        self._seq_lens[:num_rows].copy_(meta.seq_lens)
        self._block_tables[:num_rows, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._pad(num_rows, rows)

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end``: token 0 at position 0 of the scratch page, attending to that one key."""
        if start == end:
            return
        page = self._scratch_page
        self._input_ids[start:end].zero_()
        self._positions[start:end].zero_()
        self._slot_mapping[start:end].fill_(page * self._pool.block_size)
        self._seq_lens[start:end].fill_(1)
        self._block_tables[start:end, 0].fill_(page)

    def _padded_batch(self, rows: int) -> StepBatch:
        """A batch of the buffers' first ``rows`` rows; its host-side values are the same for every step."""
        attention = PagedAttentionMetadata(
            query_start_loc=self._row_ids[: rows + 1],  # [rows + 1]: one query row a sequence
            seq_lens=self._seq_lens[:rows],  # [rows]
            block_tables=self._block_tables[:rows],  # [rows, max_blocks]
            token_to_seq=self._row_ids[:rows],  # [rows]
            num_decode_seqs=rows,
            max_query_len=1,
            max_seq_len=self._max_model_len,
            query_start_loc_list=tuple(range(rows + 1)),
            seq_lens_list=(self._max_model_len,) * rows,  # the longest a row may be: sizes the split axis
        )
        return StepBatch(
            input_ids=self._input_ids[:rows],
            positions=self._positions[:rows],
            slot_mapping=self._slot_mapping[:rows],
            attention=attention,
            logits_indices=self._logits_rows[:rows],
            sampled_seqs=(),
            lora=None,
        )

    def _record(self, rows: int) -> _Recorded:
        """The bucket's graph: a run outside the capture compiles its kernels, then the capture over padding rows."""
        if not self._capture:
            recorded = self._recorded[rows] = _Recorded(None, None)
            return recorded
        self._pad(0, rows)  # every row padding while recording: only the scratch page is written
        batch = self._padded_batch(rows)
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
        logger.info("captured the CUDA graph of decode steps of %d rows", rows)
        recorded = self._recorded[rows] = _Recorded(graph, logits)
        return recorded
