"""RoutingPolicy: which replica a request goes to (the Ray Serve router's decisions, no Ray here).

cache-aware (SGLang's cache_aware policy): a replica's load is max(its engine's running +
waiting sequences, as last reported, and the requests this router has in flight on it; the
latter moves at once, the former includes other routers' requests). When the loads are
imbalanced (RouterConfig) the request goes to the least loaded replica ("least_loaded");
otherwise to the replica with the longest cached prefix for it ("prefix"), if that prefix covers
`cache_threshold` of the prompt; otherwise to the replica holding the least text
("smallest_tree"), ties broken by load then id. round-robin: each replica in turn
("round_robin"), for comparison. Every decision is counted, by reason and replica.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

from backfill.entrypoints.ray_serve.options import RouterConfig
from backfill.entrypoints.ray_serve.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes

REASONS = ("prefix", "smallest_tree", "least_loaded", "round_robin")


class RoutingPolicy:
    """Decisions, the router's in-flight requests per replica, and the prefix index.

    Thread-safe: Ray Serve calls the router from its own event loop thread while the ingress
    reads `decisions()` from another.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.index = PrefixIndex()
        self._lock = threading.Lock()
        self._in_flight: dict[str, Hashable] = {}  # request_id -> replica_id
        self._num_in_flight: Counter[Hashable] = Counter()
        self._decisions: Counter[tuple[str, str]] = Counter()  # (reason, replica label) -> count
        self._num_round_robin = 0

    def choose(self, request_id: str, text: str, replica_ids: Sequence[Hashable],
               engine_loads: Mapping[Hashable, int]) -> tuple[Hashable, str]:
        """The replica for a request and why; the request counts as in flight there (and its
        prompt as cached there) until `complete`. Choosing again for the same request (Ray
        retries when a replica refuses) moves it."""
        assert replica_ids, "no replica to choose from"
        with self._lock:
            self._release(request_id)
            loads = {r: max(engine_loads.get(r, 0), self._num_in_flight[r]) for r in replica_ids}
            hashes = block_hashes(text) if self.config.policy == "cache-aware" else []
            if self.config.policy == "round-robin":
                ordered = sorted(replica_ids, key=str)
                replica_id, reason = ordered[self._num_round_robin % len(ordered)], "round_robin"
                self._num_round_robin += 1
            elif self._imbalanced(loads):
                replica_id, reason = min(replica_ids, key=lambda r: (loads[r], str(r))), "least_loaded"
            else:
                matched = self.index.match(hashes, replica_ids)
                best = max(replica_ids, key=lambda r: (matched[r], -loads[r], str(r)))
                if hashes and matched[best] * BLOCK_CHARS >= self.config.cache_threshold * len(text):
                    replica_id, reason = best, "prefix"
                else:
                    replica_id = min(replica_ids, key=lambda r: (self.index.num_blocks(r), loads[r], str(r)))
                    reason = "smallest_tree"
            self.index.insert(hashes, replica_id)
            self._in_flight[request_id] = replica_id
            self._num_in_flight[replica_id] += 1
            return replica_id, reason

    def _imbalanced(self, loads: Mapping[Hashable, int]) -> bool:
        highest, lowest = max(loads.values()), min(loads.values())
        return (highest - lowest > self.config.balance_abs_threshold
                and highest > self.config.balance_rel_threshold * lowest)

    def record(self, reason: str, replica_label: str) -> None:
        """Count a decision (once per request, when Ray Serve has sent it)."""
        with self._lock:
            self._decisions[(reason, replica_label)] += 1

    def complete(self, request_id: str) -> None:
        """The request finished (or failed): it no longer loads its replica."""
        with self._lock:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        replica_id = self._in_flight.pop(request_id, None)
        if replica_id is not None:
            self._num_in_flight[replica_id] -= 1
            if not self._num_in_flight[replica_id]:
                del self._num_in_flight[replica_id]

    def forget(self, replica_id: Hashable) -> None:
        """A replica died: its cache is gone (a restarted one starts empty)."""
        with self._lock:
            self.index.remove(replica_id)

    def decisions(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._decisions)


_policies: list[RoutingPolicy] = []
_policies_lock = threading.Lock()


def register_policy(policy: RoutingPolicy) -> None:
    """A router of this process started: its decisions count in `all_decisions`."""
    with _policies_lock:
        _policies.append(policy)


def all_decisions() -> dict[tuple[str, str], int]:
    """(reason, replica) -> routed requests, over every router in this process."""
    total: dict[tuple[str, str], int] = {}
    with _policies_lock:
        policies = list(_policies)
    for policy in policies:
        for key, count in policy.decisions().items():
            total[key] = total.get(key, 0) + count
    return total


_reported_loads: dict[str, tuple[int, float]] = {}


def report_load(replica_label: str, load: int) -> None:
    """A replica's engine load as it sent it with a mux batch (running + waiting sequences)."""
    _reported_loads[replica_label] = (load, time.monotonic())


def reported_load(replica_label: str) -> tuple[int, float] | None:
    """The latest load `replica_label` sent with a batch, and when it came (time.monotonic())."""
    return _reported_loads.get(replica_label)
