"""The engine on a real local Ray Serve: streaming, adapter affinity, cancellation, a killed replica, usage rows,
and the replica's step thread (the one that built its engine).

Two replicas of the default model run under one Ray for the session (``ray_engine`` in conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import ray

from app.cluster.directory import DIRECTORY_NAMESPACE, EngineDirectory
from app.cluster.output_inbox import OutputInbox
from app.cluster.output_wire import RunEnded
from app.cluster.ray_client import RayEngineClient
from app.engine_clients.interface import EngineClient
from app.model_store import resolve_model
from engine import EngineStats, SamplingParams
from engine.drivers.worker_protocol import Submit
from engine.errors import UnknownAdapterError
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, sse_events, usage_rows
from tests.app.ray_fixtures import (
    NUM_REPLICAS,
    generated_by_replica,
    replica_pids,
    serving_replica,
    wait_for_replicas,
)
from tests.app.thread_ticks import thread_ticks
from tests.engine.lora_helpers import make_peft_adapter

pytestmark = [pytest.mark.default_model, pytest.mark.anyio]

NUM_ADAPTERS = 4
FRESH_SEEDS = range(21, 25)  # adapters no other test registers: no replica has loaded them
AFFINITY_ROUNDS = 6
MIN_HIT_RATE = 0.9
FREE_WAIT_S = 10.0
MAX_SPREAD_REQUESTS = 16  # base requests sent at most until both replicas run some
SETTLE_S = 1.0
FRESH_REPLICA_ATTEMPTS = 20  # rounds of two requests until one reaches the restarted replica
STARTUP_TICKS = 20  # CPU time (1/100 s) a thread spent by the time its replica joined: it did part of the start-up
MIN_STARTUP_SHARE = 0.5  # of the steps' CPU time, done by such threads; a step thread started after the build: ~0


@pytest.fixture(scope="module")
def ray_adapters(data_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small PEFT adapters of the default model, distinct bytes each."""
    root = tmp_path_factory.mktemp("ray-adapters")
    base = resolve_model("default", data_home)
    return {
        f"ad{seed}": make_peft_adapter(base, root / f"ad{seed}", seed=seed, r=4, target_modules=["q_proj", "v_proj"])
        for seed in range(11, 11 + NUM_ADAPTERS)
    }


@pytest.fixture(scope="module")
def fresh_adapters(data_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fresh-adapters")
    base = resolve_model("default", data_home)
    return {
        f"fresh{seed}": make_peft_adapter(base, root / f"fresh{seed}", seed=seed, r=4, target_modules=["q_proj"])
        for seed in FRESH_SEEDS
    }


async def _generate(engine: EngineClient, request_id: str, adapter: str | None, max_tokens: int = 2) -> list:
    ids = engine.encode_prompt("The capital of France is")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [output async for output in engine.generate(ids, params, request_id, adapter)]


async def _served_by(engine: RayEngineClient, request_id: str, adapter: str | None) -> str:
    before = generated_by_replica(await engine.worker_stats())
    await _generate(engine, request_id, adapter)
    return serving_replica(before, generated_by_replica(await engine.worker_stats()))


async def test_a_request_streams_through_the_handle_with_the_local_engines_tokens(ray_engine, thread_engine) -> None:
    remote = await _generate(ray_engine, "ray-stream", None, max_tokens=12)
    local = await _generate(thread_engine, "local-stream", None, max_tokens=12)
    assert len(remote) == len(local) == 12, "one output per generated token, streamed"
    assert remote[-1].token_ids == local[-1].token_ids
    assert remote[-1].request_finished and remote[-1].finish_reason == "length"


async def test_requests_for_an_adapter_land_on_the_replica_that_holds_it(ray_engine, ray_adapters) -> None:
    for name, folder in ray_adapters.items():
        await ray_engine.add_adapter(f"affinity-{name}", folder)
    holder: dict[str, str] = {}
    hits = total = 0
    for round_ in range(AFFINITY_ROUNDS):
        for name in ray_adapters:
            replica = await _served_by(ray_engine, f"affinity-{round_}-{name}", f"affinity-{name}")
            if name not in holder:
                holder[name] = replica
                continue
            total += 1
            hits += replica == holder[name]
    assert hits / total >= MIN_HIT_RATE, f"affinity hit rate {hits}/{total}; holders {holder}"
    assert len(set(holder.values())) == NUM_REPLICAS, "new adapters go to the replica holding the fewest"


async def test_a_new_adapters_second_request_follows_the_first_before_serve_reports_it(
    ray_engine, fresh_adapters
) -> None:
    """Serve's controller tells the gateway's router where an adapter was loaded 0.1-0.5 s after the load. A second
    request sent while the first still streams must not take the news' absence for "held nowhere" and load the
    adapter on the other replica. The two requests generate different numbers of tokens, so the replicas' counters
    tell whether one replica served both."""
    ids = ray_engine.encode_prompt("The capital of France is")
    split = []
    try:
        for name, folder in fresh_adapters.items():
            await ray_engine.add_adapter(f"pair-{name}", folder)
            before = generated_by_replica(await ray_engine.worker_stats())
            first = ray_engine.generate(
                ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), f"a-{name}", f"pair-{name}"
            )
            await anext(first)
            await _generate(ray_engine, f"b-{name}", f"pair-{name}", max_tokens=3)
            async for _ in first:
                pass
            after = generated_by_replica(await ray_engine.worker_stats())
            moved = sorted(
                after[replica] - before.get(replica, 0) for replica in after if after[replica] != before.get(replica, 0)
            )
            if moved != [8 + 3]:
                split.append((name, moved))
    finally:  # the session's replicas have small pools: later tests count resident adapters
        for name in fresh_adapters:
            if ray_engine.has_adapter(f"pair-{name}"):
                await ray_engine.remove_adapter(f"pair-{name}")
    assert not split, f"second requests served by another replica than the first: {split}"


async def test_a_cancelled_request_frees_its_pages_on_the_worker(ray_engine, ray_adapters) -> None:
    name, folder = next(iter(ray_adapters.items()))
    await ray_engine.add_adapter(f"cancel-{name}", folder)
    ids = ray_engine.encode_prompt("Count from one to a thousand:")
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    stream = ray_engine.generate(ids, params, "cancelled", f"cancel-{name}")
    async for output in stream:
        if len(output.token_ids) >= 3:
            break
    await stream.aclose()
    stats = await wait_until_idle(ray_engine)
    assert sum(one.num_generated_tokens for one in stats.values()) < 1000


@pytest.mark.parametrize("delay_s", [0.0, 0.005, 0.02])
async def test_a_request_left_before_its_first_output_is_freed_on_the_worker(ray_engine, delay_s) -> None:
    """Left before any output said which replica runs it: Serve's call is cancelled, or its first output aborted."""
    before = sum(one.num_generated_tokens for one in (await ray_engine.worker_stats()).values())
    ids = ray_engine.encode_prompt("Count from one to a thousand:")
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    stream = ray_engine.generate(ids, params, f"left-early-{delay_s}", None)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(delay_s)
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()
    await asyncio.sleep(SETTLE_S)  # a request Serve had sent already has reached its engine by now
    stats = await wait_until_idle(ray_engine)
    assert sum(one.num_generated_tokens for one in stats.values()) - before < 1000


async def test_a_submission_that_raises_leaves_no_stream_open(ray_engine) -> None:
    unencodable = [object()]  # the submission fails to encode, after the request's stream was opened
    with pytest.raises(TypeError):
        async for _ in ray_engine.generate(unencodable, SamplingParams(max_tokens=1), "raised-once", None):
            pass
    outputs = await _generate(ray_engine, "raised-once", None)  # the same id: nothing of the first is left
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"


async def test_a_gateway_whose_inbox_closes_has_its_requests_ended_on_the_replica(ray_engine) -> None:
    """A gateway gone (its inbox closed) mid-request: the replica aborts the request and its call says why."""
    inbox = OutputInbox(ray_engine._inbox_in_use().address.host)
    inbox.bind(asyncio.get_running_loop())
    ids = ray_engine.encode_prompt("Count from one to a thousand:")
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    stream = inbox.open("orphaned", ids)
    body = msgspec.msgpack.encode(Submit("orphaned", ids, params, None, None, 1.0))
    call = ray_engine.deployment.handle.run.remote(body, inbox.encoded_address)
    await asyncio.wait_for(stream.queue.queue.get(), FREE_WAIT_S)  # it runs, its outputs reach the inbox
    inbox.close()
    ended = msgspec.msgpack.decode(await asyncio.wait_for(call, FREE_WAIT_S), type=RunEnded)
    assert ended.error is not None and "lost its connection to the gateway" in ended.error.message
    await wait_until_idle(ray_engine)


async def wait_until_idle(engine: RayEngineClient) -> dict[str, EngineStats]:
    """The replicas' stats once no request runs or waits and no K/V page is held (fails after FREE_WAIT_S)."""
    deadline = time.monotonic() + FREE_WAIT_S
    while time.monotonic() < deadline:
        stats = await engine.worker_stats()
        if all(
            one.num_running == 0 and one.num_waiting == 0 and not one.pages_by_owner.get("kv") for one in stats.values()
        ):
            return stats
        await asyncio.sleep(0.1)
    pytest.fail(f"a request left by its caller still holds pages: {stats}")


async def test_usage_rows_are_the_same_as_with_the_local_engine(
    gateway_settings, ray_engine, thread_engine, tenant_adapters
) -> None:
    rows = {}
    for kind, engine in (("local", thread_engine), ("ray", ray_engine)):
        async with gateway_client(gateway_settings, engine) as (client, gateway):
            tenant = await make_tenant(gateway, f"usage-{kind}", adapters={"alpha": tenant_adapters["alpha"]})
            base = engine.model_name
            replies = [
                await client.post("/v1/chat/completions", json=chat_body(base), headers=tenant.headers),
                await client.post("/v1/chat/completions", json=chat_body("alpha"), headers=tenant.headers),
                await client.post(
                    "/v1/completions",
                    json={
                        "model": "alpha",
                        "prompt": "Once upon",
                        "max_tokens": 5,
                        "n": 2,
                        "stream": True,
                        "temperature": 0,
                    },
                    headers=tenant.headers,
                ),
            ]
            assert [reply.status_code for reply in replies] == [200, 200, 200]
            rows[kind] = [
                (
                    row.model,
                    row.adapter_id is not None,
                    row.prompt_tokens,
                    row.completion_tokens,
                    row.status,
                    row.finish_reason,
                )
                for row in await usage_rows(gateway)
                if row.tenant_id == tenant.tenant_id
            ]
    assert len(rows["ray"]) == 3
    assert rows["ray"] == rows["local"]


async def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_and_the_other_goes_on(
    gateway_settings, ray_engine, ray_adapters
) -> None:
    async with gateway_client(gateway_settings, ray_engine) as (client, gateway):
        tenant = await make_tenant(gateway, "kill-drill", adapters=ray_adapters)
        holder: dict[str, str] = {}
        for name in ray_adapters:  # one short request each, to learn which replica holds which adapter
            before = generated_by_replica(await ray_engine.worker_stats())
            reply = await client.post(
                "/v1/chat/completions", json=chat_body(name, max_tokens=2), headers=tenant.headers
            )
            assert reply.status_code == 200
            holder[name] = serving_replica(before, generated_by_replica(await ray_engine.worker_stats()))
        victim_adapter = next(iter(holder))
        victim = holder[victim_adapter]
        survivor_adapter = next(name for name, replica in holder.items() if replica != victim)
        pid = replica_pids()[victim]

        def long_stream(model: str) -> dict[str, object]:
            return chat_body(model, max_tokens=60, stream=True, ignore_eos=True)

        doomed = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=long_stream(victim_adapter), headers=tenant.headers)
        )
        other = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=long_stream(survivor_adapter), headers=tenant.headers)
        )
        deadline = time.monotonic() + FREE_WAIT_S
        while time.monotonic() < deadline:  # kill the victim once its stream is generating
            stats = await ray_engine.worker_stats()
            if stats.get(victim) is not None and stats[victim].num_running:
                break
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        doomed_reply, other_reply = await doomed, await other
        doomed_events, other_events = sse_events(doomed_reply.text), sse_events(other_reply.text)
        assert "error" in json.loads(doomed_events[-1]) and "[DONE]" not in doomed_events
        assert other_events[-1] == "[DONE]"
        rows = {row.request_id: row for row in await usage_rows(gateway)}
        doomed_row = rows[doomed_reply.headers["x-request-id"]]
        other_row = rows[other_reply.headers["x-request-id"]]
        assert doomed_row.status == "error" and other_row.status == "ok" and other_row.completion_tokens == 60
        assert len(rows) == len(ray_adapters) + 2, "exactly one usage row per request"

        joined = await asyncio.to_thread(wait_for_replicas, NUM_REPLICAS, victim)  # Serve started a new replica
        again = await client.post("/v1/chat/completions", json=chat_body(victim_adapter), headers=tenant.headers)
        assert again.status_code == 200, again.text
        # The gateway's router hears of the new replica from Serve's controller a moment later; the tests
        # after this one count on both replicas taking requests.
        fresh = next(replica for replica in joined if replica != holder[survivor_adapter])
        await _until_it_serves(ray_engine, fresh)


async def _until_it_serves(engine: RayEngineClient, replica: str) -> None:
    """Send rounds of two base-model requests until ``replica`` has served one (fails after a number of rounds)."""
    for attempt in range(FRESH_REPLICA_ATTEMPTS):
        served_before = generated_by_replica(await engine.worker_stats())
        await asyncio.gather(*(_generate(engine, f"settle-{replica}-{attempt}-{i}", None) for i in range(2)))
        if generated_by_replica(await engine.worker_stats()).get(replica, 0) > served_before.get(replica, 0):
            return
    pytest.fail(f"no request reached the restarted replica {replica} in {FRESH_REPLICA_ATTEMPTS} rounds")


async def test_pins_abort_all_and_removals_reach_every_replica(ray_engine, data_home, tmp_path) -> None:
    folder = make_peft_adapter(
        resolve_model("default", data_home), tmp_path / "pinned", seed=99, r=4, target_modules=["q_proj"]
    )
    await ray_engine.add_adapter("pinned", folder)
    before = {replica: one.num_resident_adapters for replica, one in (await ray_engine.worker_stats()).items()}
    await ray_engine.pin_adapter("pinned", True)
    pinned = {replica: one.num_resident_adapters for replica, one in (await ray_engine.worker_stats()).items()}
    assert pinned == {replica: count + 1 for replica, count in before.items()}, "resident on every replica"

    # Base requests are balanced over the replicas, but requests sent at once may all see the same loads: one more
    # is sent every 0.25 s until both replicas run some.
    streams: list[asyncio.Future] = []
    deadline = time.monotonic() + FREE_WAIT_S
    while time.monotonic() < deadline:
        if len(streams) < MAX_SPREAD_REQUESTS:
            streams.append(
                asyncio.ensure_future(_generate(ray_engine, f"abort-all-{len(streams)}", None, max_tokens=2000))
            )
        await asyncio.sleep(0.25)
        if all(one.num_running for one in (await ray_engine.worker_stats()).values()):
            break
    else:
        pytest.fail(f"{len(streams)} base requests did not spread over both replicas")
    ray_engine.abort_all()
    ended = await asyncio.wait_for(asyncio.gather(*streams), FREE_WAIT_S)
    assert [outputs[-1].finish_reason for outputs in ended] == ["abort"] * len(streams)

    await ray_engine.remove_adapter("pinned")
    removed = {replica: one.num_resident_adapters for replica, one in (await ray_engine.worker_stats()).items()}
    assert removed == before
    assert not ray_engine.has_adapter("pinned")
    with pytest.raises(UnknownAdapterError):
        await _generate(ray_engine, "after-removal", "pinned")


async def _join_when_back(directory, replica_id: str) -> list[bytes]:
    """The pins a replica joining ``directory`` gets, once the actor answers again (it may be restarting)."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return await directory.join.remote(replica_id, os.getpid())
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the directory did not come back"
            await asyncio.sleep(0.2)


async def test_a_restarted_directory_still_gives_joining_replicas_the_pins(ray_engine) -> None:
    pins_namespace = f"test-pins-{uuid.uuid4().hex}"
    directory = EngineDirectory.options(namespace=DIRECTORY_NAMESPACE, name=f"test-{pins_namespace}").remote(
        pins_namespace
    )
    try:
        await directory.broadcast.remote(b"pin a", ("digest-a", True))  # no replica yet: only recorded
        await directory.broadcast.remote(b"pin b", ("digest-b", True))
        await directory.broadcast.remote(b"unpin b", ("digest-b", False))
        assert await directory.join.remote("replica-1", os.getpid()) == [b"pin a"]
        ray.kill(directory, no_restart=False)  # its process dies; Ray starts it again
        assert await _join_when_back(directory, "replica-2") == [b"pin a"]
    finally:
        ray.kill(directory, no_restart=True)
    fresh = EngineDirectory.options(namespace=DIRECTORY_NAMESPACE, name=f"fresh-{pins_namespace}").remote(
        pins_namespace
    )
    try:
        assert await fresh.join.remote("replica-3", os.getpid()) == [], "a directory created afresh starts with none"
    finally:
        ray.kill(fresh, no_restart=True)


async def test_a_replica_steps_on_the_thread_that_built_its_engine(ray_engine) -> None:
    """libgomp's pool is per thread: stepping on another thread than the builder's is slower (engine_build.py).

    A replica started afresh (Serve replaces a killed one) has served nothing when it joins, so the threads
    that have spent CPU time by then did its start-up, the engine's build among it. They must do the steps;
    a step thread started once the engine was built would have spent nothing by then.
    """
    members = replica_pids()
    victim = next(iter(members))
    os.kill(members[victim], signal.SIGKILL)
    joined = await asyncio.to_thread(wait_for_replicas, NUM_REPLICAS, victim)
    fresh = next(replica for replica in joined if replica not in members)
    pid = joined[fresh]
    at_join = thread_ticks(pid)
    for attempt in range(FRESH_REPLICA_ATTEMPTS):
        served_before = generated_by_replica(await ray_engine.worker_stats())
        before = thread_ticks(pid)
        await asyncio.gather(*(_generate(ray_engine, f"fresh-{attempt}-{i}", None, max_tokens=48) for i in range(2)))
        after = thread_ticks(pid)
        if generated_by_replica(await ray_engine.worker_stats()).get(fresh, 0) > served_before.get(fresh, 0):
            break
    else:
        pytest.fail(f"no request reached the restarted replica {fresh} in {FRESH_REPLICA_ATTEMPTS} rounds")
    spent = {thread: ticks - before.get(thread, 0) for thread, ticks in after.items()}
    by_starters = sum(ticks for thread, ticks in spent.items() if at_join.get(thread, 0) >= STARTUP_TICKS)
    total = sum(spent.values())
    assert total > 0
    busiest = sorted(((ticks, thread, at_join.get(thread, 0)) for thread, ticks in spent.items()), reverse=True)[:4]
    assert by_starters >= MIN_STARTUP_SHARE * total, (
        f"{by_starters} of {total} ticks; (spent, thread, at join): {busiest}"
    )


def _process_environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if b"=" in entry)


def _pids_of(command: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and command in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:  # the process ended while we looked
            continue
    return pids


async def test_serve_runs_no_proxy_and_its_controller_and_replicas_have_the_gateways_settings(ray_engine) -> None:
    """The gateway calls replicas through a handle: no proxy actor, no ingress servers in the replicas; Serve's
    controller gets its slower control loop from the gateway (controller options), not from its node."""
    named = {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)}
    assert not any("PROXY" in name for name in named), named
    controllers = _pids_of("ray::ServeController")  # the session's, and any that another test's gateway started
    assert controllers
    for pid in controllers:
        controller_environment = _process_environment(pid)
        assert controller_environment.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == "0.5"
        assert controller_environment.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "0"
    for pid in replica_pids().values():
        assert _process_environment(pid).get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "0"
