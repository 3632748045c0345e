"""Which thread built each engine and which threads stepped it: they must be one (engine/drivers/engine_build.py)."""

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig

SMALL_POOL_BYTES = 32 * 1024**2  # a few short requests of the default model: these engines run one each


@dataclass
class EngineThreads:
    """Thread idents (``threading.get_ident()``) by engine (``id(engine)``)."""

    built: dict[int, int] = field(default_factory=dict)
    stepped: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    def check_stepped_where_built(self, engine: Engine) -> None:
        """The engine was stepped, and only on the thread that built it, which is not the caller's."""
        built = self.built[id(engine)]
        assert built != threading.get_ident(), "built on the test's own thread: nothing was checked"
        assert self.stepped[id(engine)] == {built}, (
            f"built on thread {built}, stepped on {sorted(self.stepped[id(engine)])}"
        )


def record_engine_threads(monkeypatch: pytest.MonkeyPatch) -> EngineThreads:
    """From now until the test ends, every Engine records the thread of its constructor and of each step."""
    threads = EngineThreads()
    build, step = Engine.__init__, Engine.step

    def recording_build(engine: Engine, config: EngineConfig) -> None:
        threads.built[id(engine)] = threading.get_ident()
        build(engine, config)

    def recording_step(engine: Engine):
        threads.stepped[id(engine)].add(threading.get_ident())
        return step(engine)

    monkeypatch.setattr(Engine, "__init__", recording_build)
    monkeypatch.setattr(Engine, "step", recording_step)
    return threads


def default_model_config() -> EngineConfig:
    """The real default model (pulled by `make test`) with a small pool."""
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    return EngineConfig(model=str(folder), pool_bytes=SMALL_POOL_BYTES, dtype="float32")
