"""The engine's LoRA tables are reused while a step's adapter runs are the last step's, their rows kept when only
the runs' token counts changed, and rebuilt on any other change."""

from pathlib import Path

import pytest

from engine.adapters.lora_batch import LoraStep, LoraStepMemo, build_lora_step
from loraplex_kernels.backend import KernelBackend
from tests.engine.conftest import make_engine
from tests.engine.lora_helpers import make_peft_adapter


def _tables(step: LoraStep) -> dict[str, tuple]:
    """What a step's tables say, group by group, as plain values."""
    return {
        name: (
            group.meta.seg_starts_list,
            group.meta.row_addr.tolist(),
            group.meta.row_start_a_list,
            group.meta.row_start_b_list,
            group.meta.ranks_list,
            group.plan.token_ids.tolist(),
        )
        for name, group in step.groups.items()
    }


@pytest.mark.parametrize("backend", [KernelBackend.NATIVE, KernelBackend.TORCH])
def test_the_same_runs_reuse_the_tables_and_any_change_rebuilds_them(
    tiny_llama: Path, tmp_path: Path, backend: KernelBackend
) -> None:
    engine = make_engine(tiny_llama)
    adapters = engine.adapters
    qv = adapters.add("qv", make_peft_adapter(tiny_llama, tmp_path / "qv", seed=1, r=4, target_modules=["q_proj"]))
    mlp = adapters.add("mlp", make_peft_adapter(tiny_llama, tmp_path / "mlp", seed=2, r=8, target_modules=["up_proj"]))
    assert adapters.acquire(qv) and adapters.acquire(mlp)
    model, storage = engine.model_config, engine.pool.storage
    memo = LoraStepMemo()

    def check(runs: list, reused: LoraStep | None) -> LoraStep:
        step = memo.build(runs, model, storage, backend)
        assert (step is reused) if reused is not None else (step is not None)
        fresh = build_lora_step(runs, model, storage, backend)
        if backend is KernelBackend.NATIVE:
            assert _tables(step) == _tables(fresh)
        else:
            assert {n: g.meta.seg_starts_list for n, g in step.groups.items()} == {
                n: g.meta.seg_starts_list for n, g in fresh.groups.items()
            }
        return step

    runs = [(1, qv), (1, qv), (1, mlp), (1, None)]
    first = check(runs, None)
    check(list(runs), first)  # the same runs in a new list: the same tables
    longer = check([(1, qv), (1, qv), (1, mlp), (1, mlp), (1, None)], None)  # a sequence of mlp joined
    assert longer is not first
    for name, group in longer.groups.items():  # the same adapters in the same order: only the counts are new
        assert group.meta.row_addr is first.groups[name].meta.row_addr
        assert group.meta.seg_starts_list != first.groups[name].meta.seg_starts_list
    shorter = check([(1, qv), (1, mlp), (1, mlp), (1, None)], None)  # one of qv left
    assert all(g.meta.row_addr is first.groups[n].meta.row_addr for n, g in shorter.groups.items())
    other = check([(1, mlp), (2, qv), (1, None)], None)  # another order: built again
    assert other is not shorter
    assert all(g.meta.row_addr is not first.groups[n].meta.row_addr for n, g in other.groups.items())

    # The adapter moves in the pool: released, evicted, loaded again into other pages (a new row table).
    reordered = memo.build([(1, mlp), (2, qv), (1, None)], model, storage, backend)
    old_rows = qv.row_addr_list
    adapters.release(qv)
    assert adapters.reclaim(len(qv.page_ids)) > 0 and not qv.is_resident
    assert adapters.acquire(qv) and qv.row_addr_list is not old_rows
    moved = check([(1, mlp), (2, qv), (1, None)], None)
    assert moved is not reordered

    assert memo.build([(3, None)], model, storage, backend) is None  # no adapter in the step
