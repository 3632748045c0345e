"""The engine on Ray Serve, behind the EngineClient interface (``LORAPLEX_ENGINE=ray``).

Each request goes through the deployment handle as one encoded Submit, with its adapter's content digest
as Serve's multiplexed model id: Serve sends it to a replica that holds that adapter, else to the one that
holds the fewest (Power of Two Choices among them); base-model requests are balanced over all replicas.
The outputs do not come back through Serve: the replica sends each engine step's outputs of all of this
gateway's requests as one frame over one connection to this gateway's output inbox (``output_inbox.py``),
where they are rebuilt into RequestOutputs as the process client does. The Serve call returns when the
request has ended, so Serve counts it as ongoing until then. A caller that leaves early sends an abort on
that connection (or cancels the call while no output has come yet), and the replica frees its pages.

The gateway keeps the tokenizer, validates adapters itself (it has the model's config) and copies them into
the store under their digest; ``add_adapter`` only records the name's digest here: a replica registers an
adapter when the first request for it arrives (Serve's multiplexed loader). Removing, pinning, ending this
gateway's requests and reading the workers' stats go to every replica through the directory actor.

A replica that dies mid-stream ends its requests with EngineDeadError (the gateway sends OpenAI's error event
and writes one ``error`` usage row each); requests on other replicas go on, Serve starts a new replica, and
the next request for its adapters loads them again there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.exceptions import RayError, RayTaskError, TaskCancelledError
from ray.serve.handle import DeploymentResponse

from app.adapters.store import copy_into_store
from app.cluster.daemon_thread import LastingThread, in_daemon_thread
from app.cluster.deployment import EngineDeployment, RaySettings, connect_ray, deploy_engine, shut_down
from app.cluster.output_inbox import OutputInbox
from app.cluster.output_wire import RunEnded
from app.engine_clients.interface import AdapterInfo
from app.engine_clients.tokenizer import GatewayTokenizer, TokenizingClient
from engine import EngineConfig, EngineStats, GrammarConstraint, RequestOutput, SamplingParams
from engine.adapters.lora_adapter import load_lora_adapter
from engine.config import ModelConfig
from engine.drivers.worker_protocol import (
    AbortRequests,
    CheckConstraint,
    Command,
    GetStats,
    PinAdapter,
    RemoveAdapter,
    Reply,
    Submit,
    from_wire,
)
from engine.errors import EngineDeadError, EngineError, RequestFailedError, UnknownAdapterError

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_ended = msgspec.msgpack.Decoder(RunEnded)
_replies = msgspec.msgpack.Decoder(Reply)
RAY_THREAD = LastingThread("loraplex-ray")  # where this process starts or joins Ray (connect_ray says why)


class RayEngineClient(TokenizingClient):
    """Engine replicas on Ray Serve; the tokenizer, adapter validation and the names' digests stay here."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        home: Path,
        ray_settings: RaySettings,
        database_url: str | None = None,
    ) -> None:
        """``database_url``: the PostgreSQL the replicas fetch adapters from (None: the store folder only)."""
        self.config = config
        self.database_url = database_url
        self.model_name = model_name
        self.home = home
        self.ray_settings = ray_settings
        self.max_model_len = 0
        self.max_prompt_chars = 0
        self.vocab_size = 0
        self._tokenizer: GatewayTokenizer | None = None
        self._model_config: ModelConfig | None = None
        self._deployment: EngineDeployment | None = None
        self._digests: dict[str, str] = {}  # adapter name -> content digest (the replicas' name for it)
        self._live: set[str] = set()  # this gateway's requests in flight (other gateways may share the replicas)
        self._inbox: OutputInbox | None = None
        self._watches: set[asyncio.Task[None]] = set()  # each request's wait for its Serve call

    async def start(self) -> None:
        """Deploy (or find) the engine replicas and wait until they serve; the tokenizer loads meanwhile."""
        if self._deployment is not None:
            return
        folder = Path(self.config.model)
        starts_ray = self.ray_settings.address is None and not ray.is_initialized()  # connect_ray starts it
        tokenizer = asyncio.ensure_future(asyncio.to_thread(GatewayTokenizer.load, folder))
        try:
            self._model_config = await asyncio.to_thread(ModelConfig.from_folder, folder)
            owns_ray = await RAY_THREAD.run(connect_ray, self.ray_settings)
            self._deployment = await in_daemon_thread(
                deploy_engine, self.config, self.home, self.ray_settings, owns_ray, self.database_url
            )
            self._tokenizer = await tokenizer
            host = await asyncio.to_thread(ray.util.get_node_ip_address)
            self._inbox = OutputInbox(host, self.ray_settings.output_port)
        except BaseException:
            await asyncio.gather(tokenizer, return_exceptions=True)
            if starts_ray and ray.is_initialized():  # a start that failed or was given up takes its Ray down
                await asyncio.to_thread(ray.shutdown)
            raise
        self.max_model_len = self._model_config.max_model_len
        self.vocab_size = self._model_config.vocab_size
        self.max_prompt_chars = self._tokenizer.max_prompt_chars(self.max_model_len)

    async def stop(self) -> None:
        """End this gateway's requests in flight; shut Ray down if this process started it."""
        deployment = self._deployment
        if deployment is None:
            return
        if self._live:
            await deployment.directory.broadcast.remote(self._abort_command())
        self._deployment = None
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        await asyncio.to_thread(shut_down, deployment)

    def is_ready(self) -> bool:
        return self._deployment is not None

    @property
    def deployment(self) -> EngineDeployment:
        if self._deployment is None:
            raise EngineError("the engine client is not started; call start() first")
        return self._deployment

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        digest = None if adapter is None else self._digest(adapter)
        inbox = self._inbox_in_use()
        stream = inbox.open(request_id, prompt_ids)
        response: DeploymentResponse | None = None
        try:  # from the stream's opening: a submission that raises leaves no stream behind
            handle = self.deployment.handle.options(multiplexed_model_id=digest or "")
            body = _encoder.encode(Submit(request_id, prompt_ids, params, digest, tenant, weight))
            response = handle.run.remote(body, inbox.encoded_address)
            watch = asyncio.ensure_future(self._watch(inbox, request_id, response))
            self._watches.add(watch)
            watch.add_done_callback(self._watches.discard)
            self._live.add(request_id)
            async for output in stream.queue.outputs(request_id):
                yield output
        finally:
            self._live.discard(request_id)
            left_early = not inbox.leave(request_id)
            if (
                left_early and response is not None
            ):  # the caller left early (a client gone): the replica frees its pages
                response.cancel()

    @staticmethod
    async def _watch(inbox: OutputInbox, request_id: str, response: DeploymentResponse) -> None:
        """Wait for the request's Serve call: it returns once the request has ended, or fails with its replica."""
        try:
            ended = _ended.decode(await response)
        except (asyncio.CancelledError, TaskCancelledError):  # the caller left (its first output, if any, is aborted)
            return
        except RayTaskError as error:  # the replica's code raised: a bug, logged on the replica
            inbox.fail(request_id, RequestFailedError(f"the engine replica failed request {request_id}: {error}"))
        except RayError as error:  # the replica died (killed, out of memory, its node gone)
            inbox.fail(
                request_id,
                EngineDeadError(f"the engine replica serving request {request_id} died: {type(error).__name__}"),
            )
        else:
            inbox.ended(request_id, ended)

    def abort_all(self) -> None:
        """End this gateway's requests in flight (not those of other gateways on the same replicas)."""
        if self._deployment is not None and self._live:
            self._deployment.directory.broadcast.remote(self._abort_command())

    async def check_constraint(self, constraint: GrammarConstraint) -> None:
        body = _encoder.encode(CheckConstraint(0, constraint))
        reply = _replies.decode(await self.deployment.handle.check_constraint.remote(body))
        if reply.error is not None:
            raise from_wire(reply.error)

    async def validate_adapter(self, path: Path) -> AdapterInfo:
        """Check a PEFT folder against the base model here, in the gateway (AdapterError if unusable)."""
        adapter = await asyncio.to_thread(load_lora_adapter, Path(path), self._model())
        return AdapterInfo(adapter.digest, adapter.max_rank, adapter.lora_alpha, adapter.modules, adapter.size_bytes)

    async def add_adapter(self, name: str, path: Path) -> str:
        """Validate the folder, make sure the store holds it by digest, and serve it under ``name``.

        No replica loads it now: the first request for it does, on the replica Serve picks.
        """
        info = await self.validate_adapter(path)
        await asyncio.to_thread(copy_into_store, Path(path), self.home, info.digest)
        self._digests[name] = info.digest
        return info.digest

    async def remove_adapter(self, name: str) -> None:
        """Forget ``name``; the replicas drop its adapter unless another name has the same bytes."""
        digest = self._digest(name)
        if list(self._digests.values()).count(digest) == 1:
            await self._broadcast(RemoveAdapter(0, digest), pin=(digest, False))
        self._digests.pop(name, None)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """Pin on every replica, and on replicas that start later."""
        digest = self._digest(name)
        await self._broadcast(PinAdapter(0, digest, pinned), pin=(digest, pinned))

    def has_adapter(self, name: str) -> bool:
        return name in self._digests

    async def worker_stats(self) -> dict[str, EngineStats]:
        replies = await self._broadcast(GetStats(0))
        return {replica_id: msgspec.convert(result, EngineStats) for replica_id, result in replies.items()}

    async def stats(self) -> EngineStats:
        """The replicas' stats added up (counts summed; adapter names merged)."""
        return merge_stats(list((await self.worker_stats()).values()))

    # Helpers ----------------------------------------------------------------------------------------

    def _digest(self, name: str) -> str:
        digest = self._digests.get(name)
        if digest is None:
            raise UnknownAdapterError(f"unknown adapter {name!r}: add it to the engine first")
        return digest

    def _inbox_in_use(self) -> OutputInbox:
        if self._inbox is None:
            raise EngineError("the engine client is not started; call start() first")
        self._inbox.bind(asyncio.get_running_loop())
        return self._inbox

    def _abort_command(self) -> bytes:
        return _encoder.encode(AbortRequests(sorted(self._live)))

    def _model(self) -> ModelConfig:
        if self._model_config is None:
            raise EngineError("the engine client is not started; call start() first")
        return self._model_config

    async def _broadcast(self, command: Command, pin: tuple[str, bool] | None = None) -> dict[str, Any]:
        """Run ``command`` on every live replica; each one's result by replica id, or the first error."""
        ref = self.deployment.directory.broadcast.remote(_encoder.encode(command), pin)
        replies = {replica_id: _replies.decode(body) for replica_id, body in (await ref).items()}
        for reply in replies.values():
            if reply.error is not None:
                raise from_wire(reply.error)
        return {replica_id: reply.result for replica_id, reply in replies.items()}


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """One EngineStats for several workers: numbers and per-key counts summed, lists merged, the rest from the first."""
    if not stats:
        raise EngineDeadError("no engine replica is running")
    merged: dict[str, Any] = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(one, field.name) for one in stats]
        first = values[0]
        if field.name in ("block_size", "page_bytes") or isinstance(first, str):
            merged[field.name] = first
        elif isinstance(first, dict):
            total: dict[str, Any] = {}
            for value in values:
                for key, count in value.items():
                    total[key] = total.get(key, 0) + count
            merged[field.name] = total
        elif isinstance(first, list):
            merged[field.name] = sorted({item for value in values for item in value})
        else:
            merged[field.name] = sum(values)
    return EngineStats(**merged)
