"""EngineReplica: a Ray Serve replica holding one engine and the single server's app over it.

Each replica is the `backfill serve` process minus uvicorn: launcher.start_engine starts its engine
core process, launcher.app_from_args builds api_server.build_app over it, and every forwarded
request runs through that app (asgi_call.call_app), so a replica answers exactly as the single
server does. The ingress handles the drain; a dead engine fails the health check and Ray Serve
replaces the replica.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

from backfill.entrypoints.openai.launcher import app_from_args, check_server_args, start_engine
from backfill.entrypoints.ray_serve.asgi_call import Accepted, ForwardedRequest, ResponseStart, call_app

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

    async def __call__(self, request: ForwardedRequest) -> AsyncGenerator[Accepted | ResponseStart | bytes, None]:
        yield Accepted()
        async for part in call_app(self._app, request):
            yield part

    async def record_routing_stats(self) -> dict[str, Any]:
        """For the router: the engine's load (running + waiting sequences); for the ingress's
        /metrics: this replica's metrics text and process id."""
        engine = self._app.state.engine
        load = engine.stats.num_running + engine.num_pending_seqs()
        text = self._app.state.metrics.render(engine.stats, engine.num_pending_seqs()).decode()
        return {"load": load, "metrics": text, "pid": os.getpid()}

    def check_health(self) -> None:
        if self._app.state.engine.is_dead:
            raise RuntimeError("the engine core died")

    def __del__(self) -> None:
        self._core.kill()
