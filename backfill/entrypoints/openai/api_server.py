"""The HTTP server: FastAPI routes, API-key and drain gate, OpenAI-shaped errors, SIGTERM drain.

Routes stay thin: parse (protocol.py), call OpenAIServing (serving.py), send. What each layer
does on trouble:
- invalid input, unknown fields that matter   -> 400 `invalid_request_error` naming `param`
- missing or wrong API key on /v1/*           -> 401 (keys compared in constant time)
- unknown model or route                      -> 404; waiting queue at --max-queue -> 429
- draining after SIGTERM                      -> 503 with Retry-After on /v1/* and /health
- more sequences than --max-seqs-per-request  -> 400 naming `prompt` or `n`, before tokenizing
A client that disconnects aborts its request: SSE responses when the send fails or the
disconnect message arrives, non-streaming ones through a watcher task racing the handler.
A request that does not arrive whole within --read-timeout has its connection closed
(transport.py), and `?api_key=` style secrets never reach the access log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from backfill.config import DTYPES, POLICIES, QUANTIZATIONS
from backfill.engine.async_engine import AsyncEngine, EngineStoppedError
from backfill.engine.core_process import CoreProcess, CoreStartError, make_engine_core
from backfill.engine.messages import CoreInfo
from backfill.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from backfill.entrypoints.openai.protocol import (MAX_BODY_BYTES, APIError, ChatCompletionRequest,
                                                  CompletionRequest, ModelCard, ModelList,
                                                  parse_request, validation_error_to_api_error)
from backfill.entrypoints.openai.serving import (DEFAULT_MAX_SEQS_PER_REQUEST, RETRY_AFTER_S, OpenAIServing,
                                                 SSEStream)
from backfill.entrypoints.openai.transport import DEFAULT_READ_TIMEOUT_S, ReadTimeoutH11Protocol, RedactSecretsFilter

if TYPE_CHECKING:
    from backfill.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# After the grace period: how long aborted responses get to send their error event, how long
# uvicorn waits for connections to close, and when the process exits whatever is still going
# on (a long step, a stuck connection): --shutdown-timeout + EXIT_GRACE_S after the signal.
ABORT_FLUSH_S = 0.2
CLOSE_CONNECTIONS_S = 0.3
EXIT_GRACE_S = 1.0
# After the engine core dies: in-flight requests fail at once, /health answers 503, and the
# server exits with status 1 this many seconds later, for a supervisor to restart it.
ENGINE_DEAD_EXIT_S = 5.0


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code, headers=error.headers)


class ServerState:
    """What the gate and the drain share: whether we still admit, and how many /v1 calls run."""

    def __init__(self) -> None:
        self.draining = False
        self.num_active = 0


class GateMiddleware:
    """Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone).

    On /v1/*: refuse with 503 while draining, check the API key, and count the call as active
    until its response is fully sent (the drain waits for that count to reach zero).
    """

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None) -> None:
        self.app = app
        self.state = state
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._key_digest is None:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # NOTE: hashing first makes the comparison constant-time in the key's length as well.
        return scheme.lower() == b"bearer" and hmac.compare_digest(
            hashlib.sha256(token.strip()).digest(), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = APIError(503, "The server is shutting down; retry on another replica.",
                             "server_error", code="shutting_down",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
            await error_response(error)(scope, receive, send)
            return
        if not self._authorized(scope):
            if b"authorization" in dict(scope.get("headers") or []):
                message, code = "Incorrect API key provided.", "invalid_api_key"
            else:
                message, code = "You didn't provide an API key.", None
            error = APIError(401, message + " Pass it as 'Authorization: Bearer <key>'.",
                             "invalid_request_error", code=code)
            await error_response(error)(scope, receive, send)
            return
        self.state.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_active -= 1


class SSEResponse(StreamingResponse):
    """A server-sent-events response that aborts its engine requests however it ends."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past MAX_BODY_BYTES before it is all in memory."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` while watching the connection; cancel it if the client goes away.

    Returns (True, result), or (False, None) when the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False, None
    finally:
        watcher.cancel()
        task.cancel()


def build_app(core: CoreProcess, info: CoreInfo, tokenizer: Tokenizer, *, served_model_name: str | None = None,
              api_key: str | None = None, max_queue: int | None = None, shutdown_timeout: float = 30.0,
              max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST) -> FastAPI:
    """The ASGI app over a started engine core process, which the app stops when it ends.

    `app.state.drain()` stops admitting, waits up to `shutdown_timeout` s for in-flight calls,
    aborts the rest (their responses get ABORT_FLUSH_S to end), and returns; the caller then
    stops the HTTP server. If the core dies, `app.state.exit(1)` is called ENGINE_DEAD_EXIT_S
    later (the launcher sets it; by default nothing happens).
    """
    name = served_model_name or info.model_name
    metrics = ServerMetrics(name, info.max_num_seqs)
    async_engine = AsyncEngine(core, info, tokenizer, max_queue=max_queue, observer=metrics)
    serving = OpenAIServing(async_engine, tokenizer, name, info.max_model_len, info.vocab_size,
                            max_seqs_per_request)
    state = ServerState()
    created = int(time.time())

    async def exit_after_death() -> None:
        await asyncio.sleep(ENGINE_DEAD_EXIT_S)
        logger.error("exiting: the engine core died")
        app.state.exit(1)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="backfill", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GateMiddleware, state=state, api_key=api_key)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.server_state = state
    app.state.exit = lambda status: None
    dead_exit: list[asyncio.Task[None]] = []  # holds the task while it sleeps
    async_engine.on_death = lambda: dead_exit.append(asyncio.ensure_future(exit_after_death()))

    async def drain() -> None:
        state.draining = True
        async_engine.stop_admitting()
        deadline = time.monotonic() + shutdown_timeout
        while state.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.num_active:
            logger.warning("grace period over: aborting %d in-flight requests", state.num_active)
            async_engine.abort_all(EngineStoppedError("the server shut down before the request finished"))
            deadline = time.monotonic() + ABORT_FLUSH_S
            while state.num_active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    app.state.drain = drain

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_to_api_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif error.status_code == 405:
            message, code = f"Method {request.method} is not allowed for {request.url.path}", None
        else:
            message, code = str(error.detail), None
        return error_response(APIError(error.status_code, message, "invalid_request_error", code=code,
                                       headers=dict(error.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, __: ClientDisconnect) -> Response:
        return Response(status_code=499)  # gone while sending its body: nothing was queued

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(error).__name__}", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_dead:
            return error_response(APIError(503, "the engine failed; the server exits", "server_error",
                                           code="engine_dead"))
        if state.draining:
            return error_response(APIError(503, "shutting down", "server_error", code="shutting_down",
                                           headers={"Retry-After": str(RETRY_AFTER_S)}))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render(async_engine.stats, async_engine.num_pending_seqs())
        return Response(body, media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=name, created=created, max_model_len=info.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(ModelList(data=[card()]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        serving.check_model(model_id)
        return _json(card())

    async def respond(request: Request, work: Awaitable[Any]) -> Response:
        connected, result = await run_unless_disconnected(request, work)
        if not connected:
            return Response(status_code=499)  # nobody reads it; the request is already aborted
        if isinstance(result, SSEStream):
            return SSEResponse(result)
        return _json(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_body(request))
        return await respond(request, serving.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_body(request))
        return await respond(request, serving.create_chat_completion(body))

    return app


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


# ---- command line --------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `backfill serve` options (also `python -m backfill.entrypoints.openai.api_server`)."""
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $BACKFILL_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    parser.add_argument("--policy", choices=POLICIES, default="continuous")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefill-budget", type=int, default=None,
                        help="while streams decode, prompt work a step may add (units of one token's linear "
                             "layers; default per device: cpu 16, cuda unlimited; 0: unlimited)")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="sequences that find no free batch slot beyond which requests get 429 (default: no limit)")
    parser.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                        help="most sequences (prompts x n) one request may create; more is a 400")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="activations and KV cache (the CPU kernels compute in float32)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="weight storage: auto (a GGUF's matrices as stored, a folder's as fp32), "
                             "none (expanded to --dtype), int8 (Q8_0 blocks), fp16; weight-only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM; the process exits by then")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a client gets to send a whole request (headers and body); then it is disconnected")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")


def exit_now(status: int) -> NoReturn:
    """End the process without the interpreter's teardown, logs and stdio flushed first.

    NOTE: tearing down torch, the weights and the KV cache takes a second or more (more on a
    loaded machine), which a SIGTERM deadline has no room for; nothing of it needs doing.
    """
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


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, exit. Returns the exit status."""
    from backfill.config import EngineConfig

    for flag, value, ok in (("--max-queue", args.max_queue, args.max_queue is None or args.max_queue >= 1),
                            ("--max-seqs-per-request", args.max_seqs_per_request, args.max_seqs_per_request >= 1),
                            ("--read-timeout", args.read_timeout, args.read_timeout > 0),
                            ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0)):
        if not ok:
            logger.error("invalid %s: %s", flag, value)
            return 2
    try:
        config = EngineConfig(
            model=args.model, policy=args.policy, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, prefill_budget=args.prefill_budget,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size, max_model_len=args.max_model_len, dtype=args.dtype,
            quantization=args.quantization,
            device=args.device, seed=args.seed, num_threads=args.num_threads)
    except ValueError as error:
        logger.error("invalid engine option: %s", error)
        return 2
    from backfill.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    # NOTE: started from the main thread: the core dies with the thread that started it.
    core = CoreProcess(functools.partial(make_engine_core, config))
    try:
        info = core.start()
    except CoreStartError as error:
        logger.error("%s", error)
        core.close()
        return 1
    try:
        status, drained = _serve(args, core, info, tokenizer)
    finally:
        core.kill()  # whatever happened: no core outlives the server
    if drained:  # after a signal: exit at once, see exit_now
        exit_now(status)
    return status


def _serve(args: argparse.Namespace, core: CoreProcess, info: CoreInfo, tokenizer: Tokenizer) -> tuple[int, bool]:
    """Serve until told to stop; returns the exit status and whether a signal drained the app."""
    api_key = args.api_key or os.environ.get("BACKFILL_API_KEY") or None
    app = build_app(core, info, tokenizer, served_model_name=args.served_model_name, api_key=api_key,
                    max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                    max_seqs_per_request=args.max_seqs_per_request)
    # NOTE: h11 explicitly (not httptools, were it installed): the read timeout hooks into it.
    http = functools.partial(ReadTimeoutH11Protocol, read_timeout=args.read_timeout)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.access_log, http=http,
                               log_level="info", timeout_graceful_shutdown=CLOSE_CONNECTIONS_S, lifespan="on")
    # After uvicorn.Config, which configures its loggers (and would drop a filter added before).
    logging.getLogger("uvicorn.access").addFilter(RedactSecretsFilter())
    server = DrainingServer(uv_config, app.state.drain, args.shutdown_timeout)
    app.state.exit = server.exit_with
    logger.info("serving %s as %r on http://%s:%d", args.model or "the default model",
                args.served_model_name or info.model_name, args.host, args.port)
    server.run()
    status = 0 if server.started else 1
    return (status if server.exit_status is None else server.exit_status), server.drain_started


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
