"""BackfillRouter: Ray Serve's RequestRouter for the engine replicas (RoutingPolicy decides).

Ray Serve runs one router per deployment handle, in the process holding the handle: the ingress
(the `backfill serve` process), which reads the decisions for /metrics through
policy.all_decisions.

NOTE: Ray Serve pickles this module by value (its globals are copied), so it holds no state of
its own: the policies register in policy.py, imported by reference.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from backfill.entrypoints.ray_serve.options import RouterConfig
from backfill.entrypoints.ray_serve.policy import RoutingPolicy, register_policy

def replica_label(replica_id: ReplicaID) -> str:
    """The `replica` label of a replica's metrics: its id within the deployment."""
    return str(replica_id.unique_id)


class BackfillRouter(RequestRouter):
    """Routes each request by RoutingPolicy; loads come from the replicas' `record_routing_stats`
    (EngineReplica: its engine's running + waiting sequences)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._policy = RoutingPolicy(RouterConfig(**kwargs))
        self._reasons: dict[str, str] = {}  # request_id -> reason of its latest choice
        register_policy(self._policy)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        args = pending_request.args
        text = getattr(args[0], "routing_text", "") if args else ""
        loads = {replica.replica_id: int(replica.routing_stats.get("load", 0)) for replica in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id
        chosen, reason = self._policy.choose(request_id, text, list(by_id), loads)
        self._reasons[request_id] = reason
        # The others after it: should the chosen one refuse, Ray Serve tries them in turn.
        return [[by_id[chosen]], [r for r in candidate_replicas if r.replica_id != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        reason = self._reasons.pop(pending_request.metadata.internal_request_id, None)
        if reason is not None:
            self._policy.record(reason, replica_label(replica_id))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._reasons.pop(internal_request_id, None)
        self._policy.complete(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.forget(replica_id)
