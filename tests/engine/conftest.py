"""Fixtures for engine tests: tiny random models, and an engine driver that checks invariants every step."""

from collections import Counter
from pathlib import Path

import pytest

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, RequestOutput
from engine.memory.page_pool import OwnerKind
from engine.scheduling.scheduler import SchedulerOutput
from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.default_model)])
def base_folder(request: pytest.FixtureRequest) -> Path:
    """The tiny random Llama, then the real default model: parity tests run on both."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_llama")
    settings = Settings.from_env()
    return resolve_model(settings.model, settings.home)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest) -> str:
    """The engine's kernel backend: parity tests run on the native CPU ops and on the torch ones."""
    return request.param


def make_engine(folder: Path, **overrides) -> Engine:
    overrides.setdefault("pool_bytes", 8 * 1024**2)
    overrides.setdefault("dtype", "float32")  # parity with transformers' fp32 forward
    overrides.setdefault("bf16_gemm", "widen")  # "auto" would pick by this machine's timings (test_bf16_gemm.py)
    return Engine(EngineConfig(model=str(folder), **overrides))


def check_invariants(engine: Engine, output: SchedulerOutput | None = None) -> None:
    """Pool bookkeeping agrees with the sequences that hold pages, and the step kept its limits."""
    engine.pool.check_invariants()
    holders: Counter[int] = Counter()
    for seq in engine.scheduler.running:
        holders.update(seq.block_ids)
    for seq in engine.scheduler.admission:
        assert not seq.block_ids, f"waiting {seq.request_id} still holds pages"
    for page in engine.pool.pages:
        if page.owner is OwnerKind.KV:
            assert holders[page.page_id] == page.ref_count, f"page {page.page_id}: {page} vs {holders[page.page_id]}"
        else:
            assert holders[page.page_id] == 0, f"page {page.page_id} is {page.owner} but held by a sequence"
    assert len(engine.scheduler.running) <= engine.config.max_num_seqs
    if output is not None:
        assert output.num_batched_tokens <= engine.scheduler.max_num_batched_tokens
        assert output.num_batched_tokens == sum(item.num_new_tokens for item in output.scheduled)


def run_checked(engine: Engine) -> dict[str, RequestOutput]:
    """Step until every request finishes, checking invariants after every step; final outputs by id."""
    finals: dict[str, RequestOutput] = {}
    schedule = engine.scheduler.schedule
    last: list[SchedulerOutput] = []

    def recording_schedule() -> SchedulerOutput:
        last.append(schedule())
        return last[-1]

    engine.scheduler.schedule = recording_schedule
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
            check_invariants(engine, last[-1])
    finally:
        engine.scheduler.schedule = schedule
    assert engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0, "pages leaked after all requests ended"
    return finals
