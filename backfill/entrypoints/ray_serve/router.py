"""BackfillRouter: Ray Serve's RequestRouter for the engine replicas (RoutingPolicy decides).

Ray Serve runs one router per deployment handle, in the process holding the handle: the ingress
(the `backfill serve` process), which reads the decisions for /metrics through
policy.all_decisions.

NOTE: Ray Serve pickles this module by value (its globals are copied), so it holds no state of
its own: the policies register in policy.py, imported by reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from backfill.entrypoints.ray_serve.asgi_call import Pinned
from backfill.entrypoints.ray_serve.options import RouterConfig
from backfill.entrypoints.ray_serve.policy import RoutingPolicy, register_policy, reported_load

# How often the router asks each replica for its engine's load. A replica streaming to this
# ingress also sends its load with every batch of events (mux.py), once per engine step: the
# router takes whichever came last. The poll covers the rest (no stream running there, or
# another ingress's requests), and is slow because each call costs the ingress and the replica
# ~1 ms of CPU: at 0.2 s the polls took ~0.8 CPU-seconds of every 30 s (2 replicas, idle).
# NOTE: Ray Serve's own `routing_stats` (what record_routing_stats returned, relayed by the
# controller) can lag by seconds, so the router asks the replicas itself.
LOAD_POLL_PERIOD_S = 1.0
LOAD_POLL_TIMEOUT_S = 5.0  # a replica that does not answer keeps its last known load


def replica_label(replica_id: ReplicaID) -> str:
    """The `replica` label of a replica's metrics: its id within the deployment."""
    return str(replica_id.unique_id)


class ReplicaGone(RuntimeError):
    """A pinned call's replica is not (or no longer) among the router's replicas."""


class BackfillRouter(RequestRouter):
    """Routes each request by RoutingPolicy; loads come from the replicas' `record_routing_stats`
    (EngineReplica: its engine's running + waiting sequences), asked every LOAD_POLL_PERIOD_S, or as
    sent with its batches of streamed events (mux.py), whichever came last.

    A call whose first argument is a `Pinned` goes to the replica it names, or fails at once
    (ReplicaGone) when that one is not there; it does not count in the policy's loads or decisions.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._policy = RoutingPolicy(RouterConfig(**kwargs))
        self._reasons: dict[str, str] = {}  # request_id -> reason of its latest choice
        self._loads: dict[ReplicaID, tuple[int, float]] = {}  # polled: (load, when it came)
        self._poller: asyncio.Task[None] | None = None
        register_policy(self._policy)

    async def _poll_loads(self) -> None:
        async def load(replica: RunningReplica) -> int:
            call = replica._actor_handle.record_routing_stats.remote()  # noqa: SLF001
            stats = await asyncio.wait_for(call, LOAD_POLL_TIMEOUT_S)
            return int(stats["load"])

        while True:
            replicas = list(self._replicas.values())
            results = await asyncio.gather(*(load(r) for r in replicas), return_exceptions=True)
            now = time.monotonic()
            self._loads.update({r.replica_id: (x, now) for r, x in zip(replicas, results) if isinstance(x, int)})
            for replica_id in set(self._loads) - set(self._replicas):
                del self._loads[replica_id]
            await asyncio.sleep(LOAD_POLL_PERIOD_S)

    def _engine_load(self, replica: RunningReplica) -> int:
        known = [x for x in (self._loads.get(replica.replica_id), reported_load(replica_label(replica.replica_id)))
                 if x is not None]
        if known:
            return max(known, key=lambda load_and_time: load_and_time[1])[0]  # the latest
        with contextlib.suppress(TypeError, ValueError):
            return int(replica.routing_stats.get("load", 0))
        return 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if self._poller is None:  # here: on the event loop the router runs on
            self._poller = asyncio.ensure_future(self._poll_loads())
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        args = pending_request.args
        if args and isinstance(args[0], Pinned):
            return self._pinned(args[0], candidate_replicas, pending_request)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        text = getattr(args[0], "routing_text", "") if args else ""
        loads = {replica.replica_id: self._engine_load(replica) for replica in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id
        chosen, reason = self._policy.choose(request_id, text, list(by_id), loads)
        self._reasons[request_id] = reason
        # The others after it: should the chosen one refuse, Ray Serve tries them in turn.
        return [[by_id[chosen]], [r for r in candidate_replicas if r.replica_id != chosen]]

    def _pinned(self, pinned: Pinned, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest) -> list[list[RunningReplica]]:
        for replica in candidate_replicas:
            if replica_label(replica.replica_id) == pinned.replica:
                return [[replica]]
        # NOTE: an empty answer would make Ray Serve ask again forever (with backoff). Failing the
        # request's future fails the call; the routing task, seeing it done, sends it nowhere.
        if not pending_request.future.done():
            pending_request.future.set_exception(ReplicaGone(f"no replica {pinned.replica}"))
        self._remove_pending_request_from_indices(pending_request)
        return [candidate_replicas]

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
