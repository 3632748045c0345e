"""A step's metadata built on the host and moved to the device in one copy (engine/memory/host_to_device.py), with the
device factored out: a fake buffer allocator and a fake copy stand for pinned memory and the H2D transfer.

The step and sampling builders are run for ``device=cuda`` on this CPU-only torch, where creating any tensor
on CUDA raises: so they pass only if every tensor is made on the host and moved through the one copy."""

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.memory.host_to_device import ALIGN_BYTES, move_to_device, pack_and_move
from engine.sampling import sampling_batch
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence
from engine.step import step_batch
from loraplex_kernels.backend import KernelBackend
from tests.engine.conftest import make_engine
from tests.engine.lora_helpers import make_peft_adapter

CUDA = torch.device("cuda")


class FakeDevice:
    """Hands out host buffers and "copies" them (a clone), recording both."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []

    def alloc(self, num_bytes: int) -> torch.Tensor:
        self.buffers.append(torch.full((num_bytes,), 0xAB, dtype=torch.uint8))  # garbage, like fresh memory
        return self.buffers[-1]

    def copy(self, buffer: torch.Tensor) -> torch.Tensor:
        assert buffer is self.buffers[-1], "the copy must move the packed buffer"
        self.copies.append(buffer.clone())
        return self.copies[-1]

    def move(self, tree, device: torch.device):
        assert device == CUDA
        return pack_and_move(tree, self.alloc, self.copy)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of the one copied buffer, at an aligned offset."""
        moved = self.copies[-1]
        offset = tensor.data_ptr() - moved.data_ptr()
        same = tensor.untyped_storage().data_ptr() == moved.untyped_storage().data_ptr()
        return same and offset % ALIGN_BYTES == 0


@dataclass(frozen=True)
class Tables:
    ints: torch.Tensor
    maybe: torch.Tensor | None
    count: int


@dataclass
class State:  # mutable: state, never walked
    pages: torch.Tensor


@dataclass(frozen=True)
class Step:
    ids: torch.Tensor
    tables: Tables
    groups: dict[str, Tables]
    pair: tuple[torch.Tensor, int]
    state: State
    empty: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.int32))


def test_every_host_tensor_moves_in_one_copy_as_an_aligned_view() -> None:
    shared = torch.tensor([7, 8, 9], dtype=torch.int32)
    tree = Step(
        ids=torch.tensor([1, 2, 3], dtype=torch.int64),
        tables=Tables(torch.arange(10, dtype=torch.int32).view(2, 5), None, 4),
        groups={"qkv": Tables(shared, torch.tensor([0.5, -1.5]), 1), "o": Tables(shared, torch.tensor([True]), 2)},
        pair=(torch.arange(5, dtype=torch.int16), 3),
        state=State(torch.ones(4)),
    )
    fake = FakeDevice()
    moved = pack_and_move(tree, fake.alloc, fake.copy)

    assert len(fake.buffers) == 1 and len(fake.copies) == 1
    pairs = [
        (moved.ids, tree.ids),
        (moved.tables.ints, tree.tables.ints),
        (moved.groups["qkv"].ints, shared),
        (moved.groups["qkv"].maybe, tree.groups["qkv"].maybe),
        (moved.groups["o"].maybe, tree.groups["o"].maybe),
        (moved.pair[0], tree.pair[0]),
    ]
    for new, old in pairs:
        assert fake.holds(new), new
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
    assert moved.empty.shape == (0, 3) and moved.empty.dtype == torch.int32  # no data: no address to check
    assert moved.groups["qkv"].ints is moved.groups["o"].ints, "a tensor named twice moves once"
    assert moved.state is tree.state, "mutable objects are not walked"
    assert moved.tables.count == 4 and moved.tables.maybe is None and moved.pair[1] == 3
    assert fake.buffers[0].numel() == sum(
        -(-old.numel() * old.element_size() // 16) * 16
        for old in (
            tree.ids,
            tree.tables.ints,
            shared,
            tree.groups["qkv"].maybe,
            tree.groups["o"].maybe,
            tree.pair[0],
            tree.empty,
        )
    )


def test_nothing_moves_on_cpu_and_an_empty_tree_costs_no_copy() -> None:
    tree = Tables(torch.arange(3), None, 0)
    assert move_to_device(tree, torch.device("cpu")) is tree
    fake = FakeDevice()
    assert pack_and_move((1, "a"), fake.alloc, fake.copy) == (1, "a") and not fake.copies


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(
        tiny_llama, tmp_path_factory.mktemp("staging") / "a", seed=3, r=4, target_modules="all-linear"
    )


def _tensors(batch: step_batch.StepBatch) -> list[torch.Tensor]:
    attention = batch.attention
    tensors = [
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.logits_indices,
        attention.query_start_loc,
        attention.seq_lens,
        attention.block_tables,
        attention.token_to_seq,
    ]
    for group in batch.lora.groups.values():
        meta = group.meta
        tensors += [
            meta.seg_starts,
            meta.row_start_a,
            meta.row_start_b,
            meta.ranks,
            meta.v_cols,
            meta.row_addr,
            meta.out_dims_table,
            meta.out_offsets_table,
        ]
    return tensors


def test_step_batch_for_cuda_is_built_on_the_host_and_moved_once(
    tiny_llama: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_llama)
    engine.add_adapter("a", adapter)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request(list(range(5, 45)), params, adapter="a")  # a prefill chunk with an adapter
    engine.add_request([9, 8, 7], params)  # base-model rows
    engine.add_request([4, 4, 5, 6], params, adapter="a")
    engine.step()
    engine.add_request(list(range(60, 90)), params)
    items = engine.scheduler.schedule().scheduled  # decode rows and a new prefill
    assert any(item.num_new_tokens == 1 for item in items) and any(item.num_new_tokens > 1 for item in items)

    fake = FakeDevice()
    monkeypatch.setattr(step_batch, "move_to_device", fake.move)
    moved = step_batch.build_step_batch(items, engine.pool, engine.model_config, CUDA, KernelBackend.TRITON)
    monkeypatch.undo()
    host = step_batch.build_step_batch(
        items, engine.pool, engine.model_config, torch.device("cpu"), KernelBackend.TRITON
    )

    assert len(fake.copies) == 1
    assert set(moved.lora.groups) == {"qkv", "o", "gate_up", "down"}
    for new, old in zip(_tensors(moved), _tensors(host), strict=True):
        assert fake.holds(new) and new.dtype == old.dtype and torch.equal(new, old)
    assert moved.attention.query_start_loc_list == host.attention.query_start_loc_list
    assert moved.sampled_seqs == host.sampled_seqs


def test_sampling_batch_for_cuda_is_built_on_the_host_and_moved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    rows = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, top_k=11, repetition_penalty=1.1),
        SamplingParams(temperature=1.2, min_tokens=4, max_tokens=8, stop_token_ids=(6,)),
    ]
    seqs = []
    for params in rows:
        seq = Sequence(
            "r",
            [rng.randrange(50) for _ in range(6)],
            params,
            detokenizer=None,  # type: ignore[arg-type]
            eos_token_ids=frozenset({2}),
        )
        seq.token_ids += [1, 1, 4]
        seqs.append(seq)
    fake = FakeDevice()
    monkeypatch.setattr(sampling_batch, "move_to_device", fake.move)
    batch = sampling_batch.build_sampling_batch(seqs, 50, CUDA)

    assert len(fake.copies) == 1
    tensors = [
        batch.temperature,
        batch.top_k,
        batch.top_p,
        batch.min_p,
        batch.penalties.flat_index,
        batch.penalties.offsets,
        batch.penalties.repetition,
        batch.logit_bias.values,
        batch.banned.rows,
        batch.greedy_rows,  # the sampler indexes the logits with it: a Python list there would be a blocking copy
    ]
    assert all(fake.holds(tensor) for tensor in tensors)
    assert batch.top_k.tolist() == [5, 11, 50]
    assert batch.greedy_rows.tolist() == [1] and batch.logprob_index is None
    assert batch.max_top_k == 50, "the largest top_k is known on the host, never read back from the device"


def test_torch_backend_plans_still_match_their_metadata_after_the_move(
    tiny_llama: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch backend's plan names the metadata it was built for; the one copy keeps that link (the plan's
    moved metadata is the group's moved metadata), so the staged step's adapters give what the host's give."""
    engine = make_engine(tiny_llama, kernels="torch")
    engine.add_adapter("a", adapter)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request(list(range(5, 45)), params, adapter="a")
    engine.add_request([9, 8, 7], params)
    items = engine.scheduler.schedule().scheduled

    fake = FakeDevice()
    monkeypatch.setattr(step_batch, "move_to_device", fake.move)
    moved = step_batch.build_step_batch(items, engine.pool, engine.model_config, CUDA, KernelBackend.TORCH)
    monkeypatch.undo()
    host = step_batch.build_step_batch(
        items, engine.pool, engine.model_config, torch.device("cpu"), KernelBackend.TORCH
    )

    assert len(fake.copies) == 1
    storage = engine.pool.storage
    generator = torch.Generator().manual_seed(7)
    for name, group in moved.lora.groups.items():
        assert group.plan is not None and group.plan.meta is group.meta
        num_tokens, in_dim = group.meta.num_tokens, group.meta.in_dim
        x = torch.randn(num_tokens, in_dim, generator=generator, dtype=storage.dtype)  # [num_tokens, in_dim]
        y_moved = torch.zeros(num_tokens, group.meta.y_width, dtype=storage.dtype)  # [num_tokens, y_width]
        y_host = y_moved.clone()
        moved.lora.apply(name, x, y_moved, 1, storage)
        host.lora.apply(name, x, y_host, 1, storage)
        assert torch.equal(y_moved, y_host) and y_host.abs().sum() > 0, name
