"""Adapters in the running engine: pressure and eviction, re-uploads, removal, pinning."""

from pathlib import Path

import pytest

from engine import RequestError, SamplingParams
from engine.errors import AdapterBusyError, PoolExhaustedError, UnknownAdapterError
from engine.memory.page_pool import OwnerKind
from tests.engine.conftest import make_engine, run_checked
from tests.engine.lora_helpers import make_peft_adapter

PAGE_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # tiny model: layers x block_size x (K, V) x kv_heads x head_dim x fp32
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 11, 40, 7, 3, 3, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("many")
    targets = [["q_proj", "v_proj"], "all-linear", ["gate_proj", "up_proj", "down_proj"]]
    return [
        make_peft_adapter(tiny_llama, root / f"a{i}", seed=100 + i, r=(4, 8, 16)[i % 3], target_modules=targets[i % 3])
        for i in range(6)
    ]


def _generate_each(engine, names: list[str | None]) -> list[list[int]]:
    ids = [engine.add_request(PROMPT, PARAMS, adapter=name) for name in names]
    finals = run_checked(engine)
    return [finals[i].token_ids for i in ids]


def test_more_adapters_than_the_pool_holds_keep_outputs(tiny_llama: Path, adapters: list[Path]) -> None:
    roomy = make_engine(tiny_llama)
    for i, folder in enumerate(adapters):
        roomy.add_adapter(f"a{i}", folder)
    names = [f"a{i}" for i in range(len(adapters))] * 2 + [None]
    expected = _generate_each(roomy, names)
    pages_per_adapter = [roomy.adapters.get(f"a{i}").layout.num_pages for i in range(len(adapters))]

    # Room for two adapters and one sequence's KV at a time: adapters are evicted and reloaded.
    tight = make_engine(tiny_llama, pool_bytes=(max(pages_per_adapter) * 2 + 4) * PAGE_BYTES)
    for i, folder in enumerate(adapters):
        tight.add_adapter(f"a{i}", folder)
    assert _generate_each(tight, names) == expected
    assert tight.adapters.num_loads > len(adapters), "the tight pool should have reloaded evicted adapters"
    assert tight.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0


def test_adapter_changes_output_and_base_rows_are_untouched(tiny_llama: Path, adapters: list[Path]) -> None:
    engine = make_engine(tiny_llama)
    engine.add_adapter("a1", adapters[1])
    with_adapter, base = _generate_each(engine, ["a1", None])
    alone = _generate_each(make_engine(tiny_llama), [None])[0]
    assert base == alone
    assert with_adapter != base


def test_same_name_reupload_never_reuses_old_kv(tiny_llama: Path, adapters: list[Path]) -> None:
    engine = make_engine(tiny_llama)
    engine.add_adapter("x", adapters[0])
    first = _generate_each(engine, ["x"])[0]
    digest_old = engine.adapters.get("x").digest
    engine.add_adapter("x", adapters[3])  # same targets and rank, different weights
    assert engine.adapters.get("x").digest != digest_old
    second_id = engine.add_request(PROMPT, PARAMS, adapter="x")
    second = run_checked(engine)[second_id]
    assert second.num_cached_tokens == 0, "blocks computed with the old weights must not be reused"
    fresh = make_engine(tiny_llama)
    fresh.add_adapter("x", adapters[3])
    assert second.token_ids == _generate_each(fresh, ["x"])[0]
    assert second.token_ids != first


def test_remove_is_refused_while_requests_use_the_adapter(tiny_llama: Path, adapters: list[Path]) -> None:
    engine = make_engine(tiny_llama)
    engine.add_adapter("busy", adapters[0])
    engine.add_request(PROMPT, PARAMS, adapter="busy")
    engine.step()
    with pytest.raises(AdapterBusyError, match="unfinished request"):
        engine.remove_adapter("busy")
    with pytest.raises(AdapterBusyError):
        engine.add_adapter("busy", adapters[3])
    run_checked(engine)
    engine.remove_adapter("busy")
    assert engine.pool.stats().pages_by_owner[OwnerKind.ADAPTER.value] == 0
    with pytest.raises(UnknownAdapterError):
        engine.add_request(PROMPT, PARAMS, adapter="busy")


def test_pinned_adapter_stays_resident_under_pressure(tiny_llama: Path, adapters: list[Path]) -> None:
    roomy = make_engine(tiny_llama)
    for i in (0, 1, 2):
        roomy.add_adapter(f"a{i}", adapters[i])
    pages = {i: roomy.adapters.get(f"a{i}").layout.num_pages for i in (0, 1, 2)}
    engine = make_engine(tiny_llama, pool_bytes=(pages[0] + max(pages[1], pages[2]) + 4) * PAGE_BYTES)
    for i in (0, 1, 2):
        engine.add_adapter(f"a{i}", adapters[i])
    engine.pin_adapter("a0")
    pinned_pages = list(engine.adapters.get("a0").page_ids)
    _generate_each(engine, ["a1", "a2", "a1", "a2"])
    assert engine.adapters.get("a0").page_ids == pinned_pages
    engine.pin_adapter("a0", pinned=False)
    _generate_each(engine, ["a1", "a2"])


def test_request_that_cannot_fit_with_its_adapter_is_refused(tiny_llama: Path, adapters: list[Path]) -> None:
    probe = make_engine(tiny_llama)
    probe.add_adapter("big", adapters[1])
    adapter_pages = probe.adapters.get("big").layout.num_pages
    engine = make_engine(tiny_llama, pool_bytes=(adapter_pages + 1) * PAGE_BYTES)
    engine.add_adapter("big", adapters[1])
    engine.add_request([5] * 20, PARAMS)  # 28 tokens: 2 pages, fits without the adapter
    with pytest.raises(RequestError, match="and its adapter cannot fit"):
        engine.add_request([5] * 20, PARAMS, adapter="big")


def test_generate_reports_requests_that_pinned_adapters_keep_out(tiny_llama: Path, adapters: list[Path]) -> None:
    probe = make_engine(tiny_llama)
    probe.add_adapter("a1", adapters[1])
    probe.add_adapter("a2", adapters[2])
    pages = {name: probe.adapters.get(name).layout.num_pages for name in ("a1", "a2")}
    engine = make_engine(tiny_llama, pool_bytes=(pages["a1"] + pages["a2"] + 1) * PAGE_BYTES)
    engine.add_adapter("a1", adapters[1])
    engine.add_adapter("a2", adapters[2])
    engine.pin_adapter("a1")
    with pytest.raises(PoolExhaustedError, match="unpin"):
        engine.generate([[5] * 20], PARAMS, adapters=["a2"])
