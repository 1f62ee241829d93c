"""The HTTP app: FastAPI routes, API-key and drain gate, OpenAI-shaped errors, the drain.

Options, uvicorn and signals (SIGTERM starts the drain) are launcher.py's.

Routes stay thin: parse (protocol.py), call OpenAIServing (serving.py), send. What each layer
does on trouble:
- invalid input, unknown fields that matter   -> 400 `invalid_request_error` naming `param`
- missing or wrong API key on /v1/*, /tokenize, /detokenize, /dashboard -> 401 (constant-time compare)
- unknown model or route                      -> 404; waiting queue at --max-queue -> 429
- draining after SIGTERM                      -> 503 with Retry-After on GATED_PATHS and /health
- more sequences than --max-seqs-per-request  -> 400 naming `prompt` or `n`, before tokenizing
A client that disconnects aborts its request: SSE responses when the send fails or the
disconnect message arrives, non-streaming ones through a watcher task racing the handler.
A request that does not arrive whole within --read-timeout has its connection closed
(transport.py), and `?api_key=` style secrets never reach the access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from backfill.engine.async_engine import AsyncEngine, EngineStoppedError
from backfill.engine.core_process import CoreProcess
from backfill.engine.messages import CoreInfo
from backfill import __version__
from backfill.entrypoints.openai.live_stats import LiveStats, dashboard_page
from backfill.entrypoints.openai.http_extras import RequestIdMiddleware, add_request_schemas, request_body
from backfill.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from backfill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from backfill.entrypoints.openai.wire import MAX_BODY_BYTES, APIError, parse_request, validation_error_to_api_error
from backfill.entrypoints.openai.responses import ResponsesRequest
from backfill.entrypoints.openai.responses_serving import ResponsesServing
from backfill.entrypoints.openai.responses_store import DEFAULT_MAX_ENTRIES as DEFAULT_MAX_STORED_RESPONSES
from backfill.entrypoints.openai.responses_store import ResponseStore
from backfill.entrypoints.openai.serving import (DEFAULT_MAX_SEQS_PER_REQUEST, RETRY_AFTER_S, OpenAIServing,
                                                 SSEStream)
from backfill.entrypoints.openai.tokenization import DetokenizeRequest, TokenizationServing, TokenizeRequest

if TYPE_CHECKING:
    from backfill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# After the grace period: how long aborted responses get to send their error event (how long
# uvicorn then waits for connections to close, and when the process exits: launcher.py).
ABORT_FLUSH_S = 0.2
# After the engine core dies: in-flight requests fail at once, /health answers 503, and the
# server exits with status 1 this many seconds later, for a supervisor to restart it.
ENGINE_DEAD_EXIT_S = 5.0
# Paths behind the API key and the drain gate (/health, /metrics and /version stay open).
GATED_PATHS = ("/v1", "/tokenize", "/detokenize")
# Behind the API key only (header, or `?key=`: see GateMiddleware); its feed is /v1/stats.
DASHBOARD_PATH = "/dashboard"


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code, headers=error.headers)


def health_response(method: str, *, dead: bool, draining: bool) -> Response:
    """/health: 200, or 503 once the engine died or while draining; HEAD: the same, no body."""
    if dead:
        response = error_response(APIError(503, "the engine failed; the server exits", "server_error",
                                           code="engine_dead"))
    elif draining:
        response = error_response(APIError(503, "shutting down", "server_error", code="shutting_down",
                                           headers={"Retry-After": str(RETRY_AFTER_S)}))
    else:
        response = JSONResponse({"status": "ok"})
    if method == "HEAD":  # the same status and headers, no body
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(status_code=response.status_code, headers=headers)
    return response


class ServerState:
    """What the gate and the drain share: whether we still admit, and how many /v1 calls run."""

    def __init__(self) -> None:
        self.draining = False
        self.num_active = 0


class GateMiddleware:
    """Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone).

    On GATED_PATHS: refuse with 503 while draining, check the API key, and count the call as active
    until its response is fully sent (the drain waits for that count to reach zero).
    """

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None) -> None:
        self.app = app
        self.state = state
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    def _key_matches(self, token: bytes) -> bool:
        assert self._key_digest is not None
        # NOTE: hashing first makes the comparison constant-time in the key's length as well.
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest)

    def _authorized(self, scope: Scope) -> bool:
        if self._key_digest is None:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and self._key_matches(token)

    def _page_authorized(self, scope: Scope) -> bool:
        """The dashboard page: a browser cannot set a header on navigation, so `?key=` works too."""
        if self._authorized(scope):
            return True
        keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [])
        return any(self._key_matches(key.encode()) for key in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == DASHBOARD_PATH:
            if self._page_authorized(scope):
                await self.app(scope, receive, send)
            else:
                error = APIError(401, "Open the dashboard as /dashboard?key=<API key>.", "invalid_request_error")
                await error_response(error)(scope, receive, send)
            return
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PATHS):
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
              max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST, price_per_hour: float | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> FastAPI:
    """The ASGI app over a started engine core process, which the app stops when it ends.

    `app.state.drain()` stops admitting, waits up to `shutdown_timeout` s for in-flight calls,
    aborts the rest (their responses get ABORT_FLUSH_S to end), and returns; the caller then
    stops the HTTP server. If the core dies, `app.state.exit(1)` is called ENGINE_DEAD_EXIT_S
    later (the launcher sets it; by default nothing happens). `price_per_hour` (USD) prices
    the dashboard's tokens. `max_stored_responses`: the Responses API's store (0: none).
    """
    name = served_model_name or info.model_name
    metrics = ServerMetrics(name, info.max_num_seqs, cache_config={
        "block_size": info.block_size, "cache_dtype": info.kv_cache_dtype, "num_gpu_blocks": info.num_kv_blocks,
        "enable_prefix_caching": info.enable_prefix_caching})
    live_stats = LiveStats(name, info.max_num_seqs, price_per_hour)
    async_engine = AsyncEngine(core, info, tokenizer, max_queue=max_queue, observers=(metrics, live_stats))
    serving = OpenAIServing(async_engine, tokenizer, name, info.max_model_len, info.vocab_size,
                            max_seqs_per_request)
    # What the first chat request and the first constrained one would build (~0.2 and ~0.3 s,
    # holding the GIL), built before the server takes requests: built by those requests, each
    # stalled every stream the server was sending.
    tokenizer.warm_up()
    serving.grammar_compiler.warm_up()
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
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so refusals carry the id too
    add_request_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                              DetokenizeRequest])
    responses = ResponsesServing(serving, ResponseStore(max_stored_responses))
    tokenization = TokenizationServing(serving)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.live_stats = live_stats
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

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        return health_response(request.method, dead=async_engine.is_dead, draining=state.draining)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render(async_engine.stats, async_engine.num_pending_seqs())
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats(since_step: int = -1) -> Response:
        body = live_stats.snapshot(async_engine.stats, async_engine.num_pending_seqs(), since_step)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        # no-referrer: the page's URL may hold the key (it loads nothing else, but links might).
        return Response(dashboard_page(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

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

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_body(request))
        return await respond(request, serving.create_completion(body))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_body(request))
        return await respond(request, serving.create_chat_completion(body))

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        body = parse_request(ResponsesRequest, await read_body(request))
        return await respond(request, responses.create_response(body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return _json(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return _json(responses.delete(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc",
                                   after: str | None = None) -> Response:
        return _json(responses.input_items(response_id, limit, order, after))

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body = parse_request(TokenizeRequest, await read_body(request))
        return _json(await tokenization.tokenize(body))

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body = parse_request(DetokenizeRequest, await read_body(request))
        return _json(await tokenization.detokenize(body))

    return app


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


if __name__ == "__main__":  # `python -m backfill.entrypoints.openai.api_server`: the launcher's main
    from backfill.entrypoints.openai.launcher import main

    sys.exit(main())
