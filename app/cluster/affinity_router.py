"""Serve's request router for the engine replicas: Power of Two Choices with model multiplexing, plus
what this router decided itself.

Serve's router learns which replica holds an adapter from the controller: the replica reports its loaded
models every 0.1 s, the controller broadcasts them on its next control loop, and the news reaches each
gateway over a long poll. Until then a second request for an adapter that was just sent to replica A
looks like a request for an adapter no replica holds, and goes to whichever replica holds the fewest, so
the adapter is loaded twice. On a loaded two-core machine that window was long enough for 3 of 20
repeated requests to miss. This router remembers where it sent each adapter the moment the replica
accepts the request, and counts that as held (for routing and for the fewest-models choice) until the
controller's broadcast says the same, or for ``PENDING_AFFINITY_S`` at most. Other gateways still learn
through the controller.

It extends Serve's own router class and its hooks (``on_request_routed``, the multiplexed-model map), which
live in Serve's private modules: they are those of the Ray the project pins (``ray[serve]==2.60.0``), and
``tests/app/test_ray_engine.py`` exercises them on a real Ray.
"""

from __future__ import annotations

import time

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica

PENDING_AFFINITY_S = 5.0  # longest a decision stands in for the controller's news (usually 0.2-0.5 s late)


class AdapterAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Routes a request to a replica that holds its adapter, counting this router's own recent decisions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[tuple[str, ReplicaID], float] = {}  # (model id, replica) -> monotonic time routed

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        model_id = pending_request.metadata.multiplexed_model_id
        if not model_id or replica_id in self._multiplexed_model_id_to_replica_ids.get(model_id, ()):
            return
        self._pending[(model_id, replica_id)] = time.monotonic()
        self._multiplexed_model_id_to_replica_ids[model_id].add(replica_id)
        self._multiplexed_model_id_fallback_match.discard(model_id)

    def _update_multiplexed_model_ids_with_replicas(self, replicas: list[RunningReplica]) -> None:
        """The controller's view, plus this router's decisions it does not show yet."""
        super()._update_multiplexed_model_ids_with_replicas(replicas)
        live = {replica.replica_id for replica in replicas}
        oldest = time.monotonic() - PENDING_AFFINITY_S
        for (model_id, replica_id), routed_at in list(self._pending.items()):
            held = self._multiplexed_model_id_to_replica_ids.get(model_id, set())
            if replica_id in held or replica_id not in live or routed_at < oldest:
                del self._pending[(model_id, replica_id)]
            else:
                self._multiplexed_model_id_to_replica_ids[model_id].add(replica_id)

    def _get_replica_ids_with_fewest_multiplexed_models(self) -> set[ReplicaID]:
        """The replicas holding the fewest adapters, counting the ones this router just sent them."""
        pending_by_replica: dict[ReplicaID, int] = {}
        for _, replica_id in self._pending:
            pending_by_replica[replica_id] = pending_by_replica.get(replica_id, 0) + 1
        counts = {
            replica.replica_id: len(replica.multiplexed_model_ids) + pending_by_replica.get(replica.replica_id, 0)
            for replica in self._replicas.values()
        }
        if not counts:
            return set()
        fewest = min(counts.values())
        return {replica_id for replica_id, count in counts.items() if count == fewest}
