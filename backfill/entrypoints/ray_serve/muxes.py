"""Muxes: the ingress's side of the per-replica muxes (mux.py), over Ray Serve and ZMQ.

One mux id per ingress (`mux_id`, sent with every request) and one ZMQ socket, where every
replica's batches arrive (`address`, bound on `host`: the replicas must reach it). A mux to each
replica is opened when the ingress starts, and whenever a request is accepted by a replica with
no open mux from here (EngineReplica.open_mux, pinned to it through the same handle and router).
Each batch goes to the requests' inboxes, and the load it carries to the router
(policy.report_load). The mux call's own Ray stream is watched by a task of its own: when it
ends or breaks (its replica died, or restarted), the requests bound to the mux fail; the next
request that replica accepts opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from backfill.entrypoints.ray_serve.asgi_call import Accepted, End, Pinned
from backfill.entrypoints.ray_serve.mux import Batch, Demux, Inbox, MuxClosed, MuxReceiver
from backfill.entrypoints.ray_serve.policy import report_load

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 1.0  # for the muxes to end once cancelled (the drain)


@dataclass
class _Mux:
    mux: int
    replica: str
    responses: DeploymentResponseGenerator
    task: asyncio.Task[None]


class Muxes:
    """One mux per replica; `num_items` counts the stream items received, by kind ("mux": a
    batch, "inline": a Ray item of a request's own stream). `start` on the running loop."""

    def __init__(self, handle: DeploymentHandle, host: str) -> None:
        self.mux_id = uuid.uuid4().hex
        self.demux = Demux()
        self.num_items: Counter[str] = Counter({"mux": 0, "inline": 0})
        self._handle = handle.options(method_name="open_mux", stream=True)
        self._open: dict[str, _Mux] = {}  # by replica label
        self._num_opened = 0
        self._closing = False
        self._receiver = MuxReceiver(host, self.mux_id, self._on_batch)

    def start(self) -> None:
        self._receiver.start()

    def _on_batch(self, mux: int, load: int, batch: Batch) -> None:
        self.num_items["mux"] += 1
        self.demux.dispatch(batch)
        for current in self._open.values():  # a few replicas: no index by mux id to keep
            if current.mux == mux and not current.task.done():
                report_load(current.replica, load)

    def bind(self, inbox: Inbox, accepted: Accepted) -> None:
        """A request was accepted: a muxed one's inbox is bound to its mux (and failed at once if
        that mux is no longer open); a replica with no open mux gets one."""
        current = self._open.get(accepted.replica)
        is_open = current is not None and not current.task.done()
        if accepted.mux:
            inbox.mux = accepted.mux
            if not is_open or current.mux != accepted.mux:  # type: ignore[union-attr]
                inbox.fail(MuxClosed(f"mux {accepted.mux} to replica {accepted.replica} is closed"))
        if not is_open and accepted.replica:
            self.open(accepted.replica)

    def open(self, replica: str) -> None:
        """Open a mux to `replica` unless one is open (or the muxes are closing)."""
        current = self._open.get(replica)
        if self._closing or (current is not None and not current.task.done()):
            return
        self._num_opened += 1
        mux = self._num_opened
        responses = self._handle.remote(Pinned(replica), self.mux_id, mux, self._receiver.address)
        self._open[replica] = _Mux(mux, replica, responses, asyncio.ensure_future(self._watch(mux, responses)))

    async def _watch(self, mux: int, responses: DeploymentResponseGenerator) -> None:
        """The mux call's Ray stream (it yields nothing): its end is the mux's."""
        failure = MuxClosed(f"mux {mux} ended")
        try:
            async for _ in responses:
                pass
        except Exception as error:  # the replica died (or the pinned call found it gone), or the drain closed it
            logger.log(logging.INFO if self._closing else logging.WARNING, "mux %d broke: %s", mux,
                       type(error).__name__)
            failure = MuxClosed(f"mux {mux} broke: {type(error).__name__}")
        finally:
            self.demux.fail_mux(mux, failure)

    async def follow(self, responses: DeploymentResponseGenerator, inbox: Inbox) -> None:
        """The rest of a muxed request's own stream, after ResponseStart: its End, or its failure,
        to its inbox."""
        try:
            async for part in responses:
                self.num_items["inline"] += 1
                if isinstance(part, End):
                    inbox.end(part.num_chunks)
                    return
            inbox.fail(MuxClosed("the request's stream ended without End"))
        except Exception as error:  # the replica died, or the request was cancelled (the drain)
            inbox.fail(error)

    async def close(self) -> None:
        """Close every mux (the drain: once no request is in flight) and open no more."""
        self._closing = True
        for mux in self._open.values():
            mux.responses.cancel()
        tasks = [mux.task for mux in self._open.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
        for task in tasks:  # NOTE: a mux Ray did not end in time is left to Ray's shutdown
            task.cancel()
        self._open.clear()
        self._receiver.close()
