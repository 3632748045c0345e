"""Where a request's time goes on the Ray engine tier, hop by hop, next to the local worker process.

One-token requests on the base model, one after another, at the engine-client level (no HTTP): first on the
local worker process (``ProcessEngineClient``), then on ONE Ray Serve replica given every CPU. The replica is
the product's ``EngineReplica`` with clocks added (a subclass deployed by this script), so each request's
timeline is split into:

- ``call``: the gateway's ``handle.run.remote()`` until the replica's ``run`` starts (the handle, Serve's
  router, the actor call reaching the replica's event loop);
- ``admit``: the replica's decoding and bookkeeping until ``worker.submit``;
- ``engine``: ``submit`` until the step thread emits the request's output (the step thread waking, the
  step itself);
- ``hop``: the emit until the replica's event loop routes it (and writes the gateway's frame);
- ``frame``: the routing until the gateway's output inbox holds the frame (the connection to the gateway);
- ``read``: the inbox until the request's reader holds the output;
- ``close``: the output until the gateway sees the request's Serve call return (not waited for).

The clocks are the host's wall clock (``time.time_ns``), which both processes share. Figures are medians
over ``--num-requests`` requests after a warm-up, with the number of frames and their bytes. The
local engine's own ``engine`` time is measured the same way (submit to emit) on an EngineWorker in this
process (``local_engine_ms``), so a replica's engine slowed by Ray's own threads shows as the difference.

    python -m scripts.profilers.profile_ray --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from app.cluster.environment import configure_ray_environment

configure_ray_environment()  # before Ray is imported, as the gateway does

import msgspec  # noqa: E402
import ray  # noqa: E402

from app.cluster import deployment as ray_deployment  # noqa: E402
from app.cluster.deployment import RaySettings  # noqa: E402
from app.cluster.output_inbox import OutputInbox  # noqa: E402
from app.cluster.ray_client import RayEngineClient  # noqa: E402
from app.cluster.replica import EngineReplica  # noqa: E402
from app.engine_clients.process import ProcessEngineClient  # noqa: E402
from app.model_store import resolve_model  # noqa: E402
from app.settings import Settings  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.drivers.worker import EngineWorker  # noqa: E402
from engine.drivers.worker_protocol import StepOutputs, Submit  # noqa: E402

logger = logging.getLogger("profile_ray")

PROMPT = "The capital of France is"
HOPS = ("call", "admit", "engine", "hop", "frame", "read", "close")


def now_ms() -> float:
    return time.time_ns() / 1e6


class TimedReplica(EngineReplica):
    """The product's replica, with the wall-clock time of each hop of each request kept for ``marks``."""

    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        await super().__init__(*args, **kwargs)
        self._marks: dict[str, dict[str, float]] = {}
        submit = self._worker.submit

        def timed_submit(request: Submit) -> None:
            self._marks[request.request_id]["submitted"] = now_ms()
            submit(request)

        self._worker.submit = timed_submit

    async def run(self, body: bytes, inbox: bytes) -> bytes:
        request_id = msgspec.msgpack.decode(body, type=Submit).request_id  # no module-level decoder: pickled by value
        self._marks[request_id] = {"entered": now_ms()}
        return await super().run(body, inbox)

    def _emit_threadsafe(self, step: StepOutputs) -> None:
        emitted = now_ms()
        for delta in step.outputs:
            self._marks.get(delta.request_id, {}).setdefault("emitted", emitted)
        super()._emit_threadsafe(step)

    def _route(self, step: StepOutputs) -> None:
        routed = now_ms()
        for delta in step.outputs:
            self._marks.get(delta.request_id, {}).setdefault("routed", routed)
        super()._route(step)

    async def marks(self) -> dict[str, dict[str, float]]:
        return self._marks


class TimedInbox:
    """The gateway's clocks: when the inbox delivers each request's first frame, and when its call returns."""

    def __init__(self, inbox: OutputInbox) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        self.num_frames: dict[str, int] = {}
        self.num_bytes: dict[str, int] = {}
        deliver, ended = inbox.deliver, inbox.ended

        def timed_deliver(connection: Any, step: StepOutputs) -> None:
            delivered = now_ms()
            size = len(msgspec.msgpack.encode(step))
            for delta in step.outputs:
                self.marks.setdefault(delta.request_id, {}).setdefault("delivered", delivered)
                self.num_frames[delta.request_id] = self.num_frames.get(delta.request_id, 0) + 1
                self.num_bytes[delta.request_id] = self.num_bytes.get(delta.request_id, 0) + size
            deliver(connection, step)

        def timed_ended(request_id: str, result: Any) -> None:
            self.marks.setdefault(request_id, {})["closed"] = now_ms()
            ended(request_id, result)

        inbox.deliver, inbox.ended = timed_deliver, timed_ended


async def ray_request(client: RayEngineClient, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """One request through RayEngineClient.generate, with the gateway's clocks."""
    request_id = uuid.uuid4().hex
    marks = {"sent": now_ms()}
    async for _ in client.generate(prompt_ids, params, request_id, None):
        marks.setdefault("received", now_ms())
    return {"request_id": request_id, **marks}


def worker_engine_ms(config: EngineConfig, prompt_ids: list[int], params: SamplingParams, n: int) -> list[float]:
    """``engine`` as the replica's worker pays it, on an EngineWorker in this process: submit until emitted."""
    done = threading.Event()
    emitted: dict[str, float] = {}

    def emit(step: StepOutputs) -> None:
        for delta in step.outputs:
            if delta.request_finished:
                emitted[delta.request_id] = now_ms()
                done.set()

    worker = EngineWorker(config, emit=emit)
    worker.start().result()
    times = []
    try:
        for index in range(n + 5):
            done.clear()
            request_id = uuid.uuid4().hex
            submitted = now_ms()
            worker.submit(Submit(request_id, prompt_ids, params, None, None, 1.0))
            done.wait()
            if index >= 5:
                times.append(emitted[request_id] - submitted)
    finally:
        worker.stop()
    return times


def ray_hops(gateway: dict[str, Any], replica: dict[str, float]) -> dict[str, float]:
    return {
        "call": replica["entered"] - gateway["sent"],
        "admit": replica["submitted"] - replica["entered"],
        "engine": replica["emitted"] - replica["submitted"],
        "hop": replica["routed"] - replica["emitted"],
        "frame": gateway["delivered"] - replica["routed"],
        "read": gateway["received"] - gateway["delivered"],
        "close": gateway["closed"] - gateway["received"],
        "total": gateway["received"] - gateway["sent"],
    }


async def local_totals(config: EngineConfig, name: str, prompt_ids: list[int], params: SamplingParams, n: int):
    client = ProcessEngineClient(config, name)
    await client.start()
    try:
        totals = []
        for index in range(n + 5):
            start = now_ms()
            async for _ in client.generate(prompt_ids, params, uuid.uuid4().hex, None):
                pass
            if index >= 5:
                totals.append(now_ms() - start)
        return totals
    finally:
        await client.stop()


async def ray_timelines(config: EngineConfig, name: str, home: Path, prompt_ids, params, n: int):
    ray_deployment.EngineReplica = TimedReplica  # deployed in place of the product's class
    client = RayEngineClient(config, name, home, RaySettings(num_replicas=1))
    await client.start()
    try:
        inbox = TimedInbox(client._inbox_in_use())
        sent = [await ray_request(client, prompt_ids, params) for _ in range(n + 5)][5:]
        await asyncio.sleep(0.5)  # the last calls' returns
        marks = await client.deployment.handle.marks.remote()
        timelines = []
        for gateway in sent:
            request_id = gateway["request_id"]
            timelines.append(
                ray_hops(gateway | inbox.marks[request_id], marks[request_id])
                | {"num_frames": inbox.num_frames[request_id], "num_bytes": inbox.num_bytes[request_id]}
            )
        return timelines
    finally:
        await client.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    config = EngineConfig(model=str(folder), dtype="float32")
    home = settings.home / "bench" / "profile-ray"
    home.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(folder).encode(PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    local = asyncio.run(local_totals(config, folder.name, prompt_ids, params, args.num_requests))
    local_engine = worker_engine_ms(config, prompt_ids, params, args.num_requests)
    # Ray started on this thread, which lives as long as the script: Ray's processes die with the thread that
    # started them (PR_SET_PDEATHSIG), and asyncio.run's executor threads end with their loop.
    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    timelines = asyncio.run(ray_timelines(config, folder.name, home, prompt_ids, params, args.num_requests))
    ray.shutdown()
    result: dict[str, Any] = {
        "local_total_ms": round(statistics.median(local), 3),
        "local_engine_ms": round(statistics.median(local_engine), 3),
    }
    for key in (*HOPS, "total", "num_frames", "num_bytes"):
        result[f"ray_{key}" + ("" if key.startswith("num_") else "_ms")] = round(
            statistics.median(timeline[key] for timeline in timelines), 3
        )
    result["ray_overhead_ms"] = round(result["ray_total_ms"] - result["local_total_ms"], 3)
    result["num_requests"] = args.num_requests
    sys.stdout.write((json.dumps(result) if args.json else json.dumps(result, indent=1)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
