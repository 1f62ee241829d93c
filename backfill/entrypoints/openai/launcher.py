"""Starting the HTTP server: `backfill serve` options, uvicorn, and the SIGTERM drain.

The app itself (routes, gate, errors, `app.state.drain`) is api_server.build_app; this module
parses the options, loads the engine, runs uvicorn, and turns the first SIGTERM/SIGINT into a
drain with a deadline (DrainingServer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import uvicorn
from fastapi import FastAPI

from backfill.config import EngineConfig
from backfill.engine.core_process import CoreProcess, CoreStartError, make_engine_core
from backfill.engine.messages import CoreInfo
from backfill.entrypoints.openai.api_server import build_app
from backfill.entrypoints.openai.responses_store import DEFAULT_MAX_ENTRIES
from backfill.entrypoints.openai.serving import DEFAULT_MAX_SEQS_PER_REQUEST
from backfill.entrypoints.ray_serve.options import add_ray_arguments
from backfill.entrypoints.openai.transport import DEFAULT_READ_TIMEOUT_S, ReadTimeoutHttpProtocol, RedactSecretsFilter

if TYPE_CHECKING:
    from backfill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# After the grace period (api_server.ABORT_FLUSH_S for aborted responses): how long uvicorn
# waits for connections to close, and when the process exits whatever is still going on (a
# long step, a stuck connection): --shutdown-timeout + EXIT_GRACE_S after the signal.
CLOSE_CONNECTIONS_S = 0.3
EXIT_GRACE_S = 1.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `backfill serve` options (also `python -m backfill.entrypoints.openai.api_server`):
    the server's own, then every EngineConfig field's (EngineConfig.add_cli_args)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $BACKFILL_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="sequences that find no free batch slot beyond which requests get 429 (default: no limit)")
    parser.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                        help="most sequences (prompts x n) one request may create; more is a 400")
    parser.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_ENTRIES,
                        help="responses (/v1/responses with store) kept in memory for previous_response_id and "
                             "GET /v1/responses/{id}, least recently used dropped first (also at most 256 MiB); "
                             "0: none")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM; the process exits by then")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a client gets to send a whole request (headers and body); then it is disconnected")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--price-per-hour", type=float, default=None,
                        help="USD per hour of the machine: /dashboard and /v1/stats show the cost per 1M output tokens")
    add_ray_arguments(parser)
    EngineConfig.add_cli_args(parser)


# Run by exit_now first (the Ray server stops its local Ray instance there): os._exit skips atexit.
EXIT_HOOKS: list[Callable[[], None]] = []


def exit_now(status: int) -> NoReturn:
    """End the process without the interpreter's teardown, logs and stdio flushed first.

    NOTE: tearing down torch, the weights and the KV cache takes a second or more (more on a
    loaded machine), which a SIGTERM deadline has no room for; nothing of it needs doing.
    """
    for hook in EXIT_HOOKS:
        with contextlib.suppress(Exception):
            hook()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the app instead of closing the socket.

    uvicorn's own handling closes the listening socket at once (new clients would see
    'connection refused', not a 503) and re-raises the signal on exit (exit status -15).
    A second signal exits at once. Whatever happens, the process is gone `shutdown_timeout`
    + EXIT_GRACE_S seconds after the first signal (a watchdog thread sees to it).
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]],
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.drain_started = False
        self.exit_status: int | None = None

    def exit_with(self, status: int) -> None:
        """Stop serving (connections get CLOSE_CONNECTIONS_S to close); `run()` returns and
        the process exits with `status`."""
        self.exit_status = status
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started or self._loop is None:
            logger.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        self.drain_started = True
        logger.warning("received %s: draining", signal.Signals(sig).name)
        watchdog = threading.Timer(self._shutdown_timeout + EXIT_GRACE_S, self._exit_late)
        watchdog.daemon = True
        watchdog.start()
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    @staticmethod
    def _exit_late() -> None:
        logger.warning("still shutting down %.1f s after the grace period: exiting now", EXIT_GRACE_S)
        exit_now(0)

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def check_server_args(args: argparse.Namespace) -> EngineConfig | None:
    """The engine config from the `backfill serve` options, or None (logged) when one is invalid."""
    for flag, value, ok in (("--max-queue", args.max_queue, args.max_queue is None or args.max_queue >= 1),
                            ("--max-seqs-per-request", args.max_seqs_per_request, args.max_seqs_per_request >= 1),
                            ("--max-stored-responses", args.max_stored_responses, args.max_stored_responses >= 0),
                            ("--read-timeout", args.read_timeout, args.read_timeout > 0),
                            ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0),
                            ("--price-per-hour", args.price_per_hour,
                             args.price_per_hour is None or args.price_per_hour >= 0)):
        if not ok:
            logger.error("invalid %s: %s", flag, value)
            return None
    try:
        return EngineConfig.from_cli_args(args)
    except ValueError as error:
        logger.error("invalid engine option: %s", error)
        return None


def start_engine(config: EngineConfig) -> tuple[CoreProcess, CoreInfo, Tokenizer]:
    """Start the engine core process and load the tokenizer meanwhile; raises (the core
    closed) when the model cannot be loaded. Call it from the thread the core should die with."""
    from backfill.tokenizer import load_tokenizer

    core = CoreProcess(functools.partial(make_engine_core, config))
    core.launch()  # the model loads there while the tokenizer loads here
    try:
        tokenizer = load_tokenizer(config.model)
        tokenizer.warm_up()  # (build_app would: here it overlaps the model's load)
        info = core.wait_ready()
    except BaseException:
        core.close()
        raise
    return core, info, tokenizer


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The key clients must send: --api-key, else $BACKFILL_API_KEY; None (no key) when neither is set."""
    return args.api_key or os.environ.get("BACKFILL_API_KEY") or None


def app_from_args(args: argparse.Namespace, core: CoreProcess, info: CoreInfo, tokenizer: Tokenizer) -> FastAPI:
    """build_app with the `backfill serve` options: the single server's app, and each Ray replica's."""
    return build_app(core, info, tokenizer, served_model_name=args.served_model_name, api_key=api_key_from_args(args),
                     max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                     max_seqs_per_request=args.max_seqs_per_request, price_per_hour=args.price_per_hour,
                     max_stored_responses=args.max_stored_responses)


def serve_app(app: FastAPI, args: argparse.Namespace, drain: Callable[[], Awaitable[None]]) -> tuple[int, bool]:
    """Run uvicorn over `app` until told to stop (a signal drains through `drain`); returns the
    exit status and whether a signal drained the app."""
    # NOTE: our protocol class, not uvicorn's choice: the read timeout hooks into it.
    http = functools.partial(ReadTimeoutHttpProtocol, read_timeout=args.read_timeout)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.access_log, http=http,
                               log_level="info", timeout_graceful_shutdown=CLOSE_CONNECTIONS_S, lifespan="on")
    # After uvicorn.Config, which configures its loggers (and would drop a filter added before).
    logging.getLogger("uvicorn.access").addFilter(RedactSecretsFilter())
    server = DrainingServer(uv_config, drain, args.shutdown_timeout)
    app.state.exit = server.exit_with
    server.run()
    status = 0 if server.started else 1
    return (status if server.exit_status is None else server.exit_status), server.drain_started


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, exit. Returns the exit status.
    With --replicas (or --ray-address): N engines behind one endpoint on Ray Serve."""
    if args.replicas is not None or args.ray_address is not None:
        # NOTE: imported here only: the single-process server never imports Ray.
        from backfill.entrypoints.ray_serve.launcher import run_ray_server

        if args.max_stored_responses:  # each replica would keep its own: a continuation could miss it
            logger.info("the Responses API's store is off with replicas (each would keep its own): "
                        "responses are not stored, send whole conversations")
            args.max_stored_responses = 0
        return run_ray_server(args)
    config = check_server_args(args)
    if config is None:
        return 2
    # NOTE: started from the main thread: the core dies with the thread that started it.
    try:
        core, info, tokenizer = start_engine(config)
    except (CoreStartError, OSError, ValueError) as error:  # no such model, or one we cannot load
        logger.error("%s", error)
        return 1
    try:
        app = app_from_args(args, core, info, tokenizer)
        logger.info("serving %s as %r on http://%s:%d", args.model or "the default model",
                    args.served_model_name or info.model_name, args.host, args.port)
        status, drained = serve_app(app, args, app.state.drain)
    finally:
        core.kill()  # whatever happened: no core outlives the server
    if drained:  # after a signal: exit at once, see exit_now
        exit_now(status)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backfill.entrypoints.openai.api_server",
                                     description="OpenAI-compatible server for backfill")
    add_serve_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
