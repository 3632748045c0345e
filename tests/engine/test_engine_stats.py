"""What Engine.stats() tells a router: the adapters of running and waiting sequences, and how many fit."""

from pathlib import Path

import msgspec
import pytest

from engine import EngineStats, SamplingParams
from engine.memory.page_pool import OwnerKind
from tests.engine.conftest import make_engine, run_checked
from tests.engine.lora_helpers import make_peft_adapter

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 11, 40, 7, 3, 3, 3, 12, 13]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stats-adapters")
    return {
        name: make_peft_adapter(tiny_llama, root / name, seed=seed, r=4, target_modules=["q_proj", "v_proj"])
        for name, seed in (("red", 1), ("green", 2), ("blue", 3))
    }


@pytest.mark.parametrize("policy", ["fair", "fifo"])
def test_stats_name_the_adapters_of_running_and_waiting_sequences(
    tiny_llama: Path, adapters: dict[str, Path], policy: str
) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=2, scheduling_policy=policy)
    for name, folder in adapters.items():
        engine.add_adapter(name, folder)
    for adapter in ("red", None, "green", "blue", "green", None):
        engine.add_request(PROMPT, PARAMS, adapter=adapter, tenant="acme")
    engine.step()

    stats = engine.stats()

    assert stats.num_running == 2 and stats.num_waiting == 4
    assert stats.running_adapters == ["red"], "the base-model request names no adapter"
    assert stats.waiting_adapters == ["blue", "green"], "sorted, each name once"
    assert stats.max_adapters == engine.adapters.capacity() >= 1
    assert stats.pages_by_owner[OwnerKind.KV.value] > 0
    assert msgspec.convert(msgspec.to_builtins(stats), EngineStats) == stats, "crosses the process boundary"

    run_checked(engine)
    idle = engine.stats()
    assert idle.running_adapters == [] and idle.waiting_adapters == []
