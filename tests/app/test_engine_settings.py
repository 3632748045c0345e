"""Where the engine runs, from the environment: the local engine by default, Ray Serve on request."""

from __future__ import annotations

import pytest

from app.cluster.deployment import RaySettings
from app.cluster.ray_client import RayEngineClient, merge_stats
from app.engine_clients.process import ProcessEngineClient
from app.gateway import make_engine
from app.settings import Settings, SettingsError
from engine import EngineStats


def test_the_local_engine_is_the_default_and_process_still_names_it() -> None:
    assert Settings.from_env({}).engine == "local"
    assert Settings.from_env({"LORAPLEX_ENGINE": "process"}).engine == "process"


def test_ray_settings_are_read_with_their_defaults() -> None:
    settings = Settings.from_env({"LORAPLEX_ENGINE": "ray"})
    assert (settings.ray_address, settings.ray_replicas, settings.ray_replica_cpus, settings.ray_replica_gpus) == (
        None,
        1,
        None,
        0.0,
    )
    settings = Settings.from_env(
        {
            "LORAPLEX_ENGINE": "Ray",
            "LORAPLEX_RAY_ADDRESS": "ray://head:10001",
            "LORAPLEX_RAY_REPLICAS": "8",
            "LORAPLEX_RAY_REPLICA_CPUS": "0",
            "LORAPLEX_RAY_REPLICA_GPUS": "0.5",
        }
    )
    assert (settings.engine, settings.ray_address, settings.ray_replicas) == ("ray", "ray://head:10001", 8)
    assert (settings.ray_replica_cpus, settings.ray_replica_gpus) == (0.0, 0.5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LORAPLEX_ENGINE": "cluster"}, "LORAPLEX_ENGINE must be one of local, process, thread, ray"),
        ({"LORAPLEX_RAY_REPLICA_CPUS": "-1"}, "at least 0"),
        ({"LORAPLEX_RAY_REPLICA_GPUS": "one"}, "must be a number"),
        ({"LORAPLEX_RAY_REPLICA_CPUS": "nan"}, "at least 0"),
        ({"LORAPLEX_RAY_REPLICAS": "0"}, "at least 1"),
    ],
)
def test_bad_engine_settings_say_what_to_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


@pytest.mark.default_model
def test_the_settings_pick_the_engine_client(data_home) -> None:
    local = make_engine(Settings(home=data_home, model="default"))
    ray = make_engine(
        Settings(
            home=data_home, model="default", engine="ray", ray_replicas=3, ray_replica_cpus=0.5, ray_output_port=7010
        )
    )
    assert isinstance(local, ProcessEngineClient)
    assert isinstance(ray, RayEngineClient)
    assert ray.ray_settings == RaySettings(None, 3, 0.5, 0.0, 7010)


def test_worker_stats_add_up_across_replicas() -> None:
    def stats(running: int, kv: int, counters: dict[str, float]) -> EngineStats:
        return EngineStats(
            num_pages=100,
            block_size=16,
            page_bytes=4096,
            pages_by_owner={"free": 100 - kv, "kv": kv},
            num_running=running,
            num_waiting=1,
            num_resident_adapters=2,
            num_preemptions=0,
            num_prompt_tokens=10,
            num_cached_prompt_tokens=0,
            num_generated_tokens=5,
            tenant_counters=counters,
        )

    merged = merge_stats([stats(2, 10, {"a": 1.0}), stats(3, 20, {"a": 2.0, "b": 4.0})])
    assert (merged.num_pages, merged.block_size, merged.num_running, merged.num_waiting) == (200, 16, 5, 2)
    assert merged.pages_by_owner == {"free": 170, "kv": 30}
    assert merged.tenant_counters == {"a": 3.0, "b": 4.0}
