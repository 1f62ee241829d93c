"""EngineReplica: a Ray Serve replica holding one engine and the single server's app over it.

Each replica is the `backfill serve` process minus uvicorn: launcher.start_engine starts its engine
core process, launcher.app_from_args builds api_server.build_app over it, and every forwarded
request runs through that app (asgi_call.call_app), so a replica answers exactly as the single
server does. The event-stream bodies of an ingress's requests go through that ingress's mux
(open_mux; mux.py) when it has one open here, in batches, over ZMQ. The ingress handles the drain; a dead
engine fails the health check and Ray Serve replaces the replica.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from backfill.entrypoints.openai.launcher import app_from_args, check_server_args, start_engine

from backfill.entrypoints.ray_serve.asgi_call import (BODY_END, Accepted, End, ForwardedRequest, Pinned,
                                                      ResponseStart, call_app, is_event_stream)
from backfill.entrypoints.ray_serve.mux import MuxSender, Outbox
from backfill.entrypoints.ray_serve.router import replica_label

logger = logging.getLogger(__name__)


class EngineReplica:
    """The deployment's class (ray_serve.launcher wraps it with serve.deployment)."""

    async def __init__(self, server_args: dict[str, Any]) -> None:
        args = argparse.Namespace(**server_args)
        config = check_server_args(args)
        if config is None:
            raise ValueError("invalid server options (see the log)")
        # NOTE: Ray Serve runs the constructor on the replica's user-code thread, which lives as
        # long as the replica: the core process dies with that thread (PR_SET_PDEATHSIG).
        self._core, info, tokenizer = start_engine(config)
        self._app = app_from_args(args, self._core, info, tokenizer)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self._app.router.lifespan_context(self._app))
        self._label = replica_label(serve.get_replica_context().replica_id)
        self._outboxes: dict[str, Outbox] = {}  # by the ingress's mux_id

    async def __call__(self, request: ForwardedRequest) -> AsyncGenerator[Accepted | ResponseStart | End | bytes, None]:
        outbox = self._outboxes.get(request.mux_id) if request.mux_id else None
        yield Accepted(self._label, outbox.mux if outbox is not None else 0)
        muxed, num_chunks, complete = False, 0, False
        async for part in call_app(self._app, request):
            if isinstance(part, ResponseStart):
                muxed = outbox is not None and is_event_stream(part.headers)
                yield part
            elif part is BODY_END:
                # NOTE: the stream's end goes in the same batch as its last chunk (put in the same
                # turn of the loop), not after the app returns: a client that hangs up at [DONE]
                # must not find the ingress still waiting for it.
                if muxed:
                    outbox.put(request.stream_key, None)  # type: ignore[union-attr]
                    complete = True
            elif muxed:
                outbox.put(request.stream_key, part)  # type: ignore[union-attr]
                num_chunks += 1
            else:
                yield part
        if muxed:
            if not complete:  # the app returned mid-body
                outbox.put(request.stream_key, None)  # type: ignore[union-attr]
            yield End(num_chunks)

    async def open_mux(self, pinned: Pinned, mux_id: str, mux: int, address: str) -> AsyncGenerator[None, None]:
        """The ingress `mux_id`'s mux here (its id there: `mux`), as long as the ingress keeps
        this call open: the event-stream chunks of its requests, in batches, sent to its socket
        at `address` with this replica's load. The call itself yields nothing. A newer mux from
        the same ingress replaces it."""
        assert pinned.replica == self._label, (pinned, self._label)
        if (previous := self._outboxes.get(mux_id)) is not None:
            previous.close()
        self._outboxes[mux_id] = outbox = Outbox(mux)
        sender = MuxSender(address, mux_id, mux)
        try:
            async for batch in outbox.batches():
                sender.send(batch, self._load())
        finally:
            sender.close()
            if self._outboxes.get(mux_id) is outbox:
                del self._outboxes[mux_id]
        return
        yield  # NOTE: unreachable; makes this an async generator (a Ray stream) that yields nothing

    def _load(self) -> int:
        engine = self._app.state.engine
        return engine.stats.num_running + engine.num_pending_seqs()

    async def metrics_text(self, pinned: Pinned) -> str:
        """For the ingress's /metrics: this replica's metrics text."""
        assert pinned.replica == self._label, (pinned, self._label)
        engine = self._app.state.engine
        return self._app.state.metrics.render(engine.stats, engine.num_pending_seqs()).decode()

    async def record_routing_stats(self) -> dict[str, Any]:
        """For the router: the engine's load (running + waiting sequences), and the process id.
        NOTE: asked several times a second: only what is cheap (the metrics text is not)."""
        return {"load": self._load(), "pid": os.getpid()}

    def check_health(self) -> None:
        if self._app.state.engine.is_dead:
            raise RuntimeError("the engine core died")

    def __del__(self) -> None:
        self._core.kill()
