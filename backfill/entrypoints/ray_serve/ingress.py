"""The ingress app of `backfill serve --replicas N`: one OpenAI endpoint over N engine replicas.

It runs in the `backfill serve` process under uvicorn (launcher.serve_app, as the single server
does) and stays light: the same gate as the single server (API key, 503 while draining), then
every request is forwarded whole (method, path, headers, body) through the deployment handle to
a replica chosen by BackfillRouter, which runs the single server's app on it and streams the
response back. Server-sent events are passed on as they come; other responses are sent once
complete, so a replica that dies first still gets the client a proper error. The events come
through the replica's mux (muxes.py): one ZMQ message per batch of all the ingress's streams
there, to a socket this process binds on `mux_host` (the address of this node in Ray).

- a replica dying mid-request      -> 503 `replica_failed` (or, mid-stream, an error event and [DONE]);
                                      one dying before it accepted the request: another replica
- draining after SIGTERM           -> 503 for new requests; in-flight ones get --shutdown-timeout,
                                      then are cancelled (their replicas abort them)
- /metrics                         -> every replica's series with a `replica` label, and
                                      backfill:router_requests_total{reason,replica},
                                      backfill:ray_stream_items_total{kind="mux"|"inline"}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from backfill import __version__
from backfill.entrypoints.openai.api_server import (ABORT_FLUSH_S, GateMiddleware, ServerState, error_response,
                                                    health_response, read_body)
from backfill.entrypoints.openai.http_extras import RequestIdMiddleware
from backfill.entrypoints.openai.metrics import CONTENT_TYPE
from backfill.entrypoints.openai.serving import RETRY_AFTER_S, SSE_DONE, sse
from backfill.entrypoints.openai.wire import APIError
from backfill.entrypoints.ray_serve.asgi_call import Accepted, ForwardedRequest, Pinned, ResponseStart, is_event_stream
from backfill.entrypoints.ray_serve.metrics_merge import merge_metrics, router_metrics, stream_item_metrics
from backfill.entrypoints.ray_serve.mux import Inbox
from backfill.entrypoints.ray_serve.muxes import Muxes
from backfill.entrypoints.ray_serve.prefix_index import routing_text
from backfill.entrypoints.ray_serve.policy import all_decisions

logger = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 10.0  # a replica that does not answer in time is left out of /metrics
MAX_ATTEMPTS = 3  # replicas a request is sent to when they fail before answering


def replica_failed() -> APIError:
    return APIError(503, "the engine replica serving this request failed; retry it", "server_error",
                    code="replica_failed", headers={"Retry-After": str(RETRY_AFTER_S)})


def shut_down() -> APIError:
    return APIError(503, "the server shut down before the request finished", "server_error",
                    code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


_SSE_DONE_BYTES = SSE_DONE.encode()


def _sse_error_end(error: APIError) -> bytes:
    return (sse(error.to_dict()) + SSE_DONE).encode()


class Forwarder:
    """Sends requests to the replicas and their responses back; tracks what is in flight."""

    def __init__(self, handle: DeploymentHandle, replica_name_prefix: str, mux_host: str) -> None:
        self._handle = handle.options(stream=True)
        self._metrics_handle = handle.options(method_name="metrics_text", stream=False)
        self._replica_name_prefix = replica_name_prefix
        self._in_flight: set[DeploymentResponseGenerator] = set()
        self._followers: set[asyncio.Task[None]] = set()
        self.muxes = Muxes(handle, mux_host)
        self.draining = False  # the server is shutting down (the drain started)
        self.aborting = False  # ... and its grace period is over

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            body = await read_body(request)
        except APIError as error:
            await error_response(error)(scope, receive, send)
            return
        except ClientDisconnect:
            return
        text = ""
        with contextlib.suppress(ValueError, AttributeError):
            parsed = json.loads(body) if body else {}
            text = routing_text(scope["path"], parsed) if isinstance(parsed, dict) else ""
        # A replica that fails before accepting the request (it died, or Ray had not yet noticed
        # it dead) never ran it: the request goes to another, up to MAX_ATTEMPTS times (each with
        # a stream key of its own: nothing a failed attempt sent can reach the next one's inbox).
        for attempt in range(1, MAX_ATTEMPTS + 1):
            key, inbox = self.muxes.demux.add()
            forwarded = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                         list(scope.get("headers") or []), body, scope.get("client"), text,
                                         mux_id=self.muxes.mux_id, stream_key=key)
            responses = self._handle.remote(forwarded)
            self._in_flight.add(responses)
            watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
            relay = asyncio.ensure_future(self._relay(responses, inbox, send, last_attempt=attempt == MAX_ATTEMPTS))
            try:
                await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not relay.done():  # the client went away: the replica aborts the request
                    responses.cancel()
                    relay.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await relay
                    return
                if relay.result():
                    return
            finally:
                watcher.cancel()
                self._in_flight.discard(responses)
                self.muxes.demux.remove(key)

    async def _relay(self, responses: DeploymentResponseGenerator, inbox: Inbox, send: Send,
                     last_attempt: bool) -> bool:
        """Pass the response on; False (nothing sent) when the replica failed before accepting
        the request and another may be tried. A muxed event stream's body comes from `inbox`."""
        accepted, mux = False, 0
        start: ResponseStart | None = None
        streaming = False
        chunks: list[bytes] = []
        tail = b""  # an event stream's last bytes sent (its end is checked for [DONE])
        try:
            async for part in responses:
                self.muxes.num_items["inline"] += 1
                if isinstance(part, Accepted):
                    accepted, mux = True, part.mux
                    self.muxes.bind(inbox, part)
                elif isinstance(part, ResponseStart):
                    start = part
                    streaming = is_event_stream(part.headers)
                    if streaming:
                        await send({"type": "http.response.start", "status": part.status, "headers": part.headers})
                        if mux:
                            break
                elif streaming:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    tail = (tail + part)[-len(_SSE_DONE_BYTES):]
                else:
                    chunks.append(part)
            if streaming and mux:
                # NOTE: the body may be complete (the mux says so) before End comes: the response
                # ends then, and the follower is left to read End (Ray Serve counts the request
                # in flight until its stream ends).
                follower = asyncio.ensure_future(self.muxes.follow(responses, inbox))
                self._followers.add(follower)
                follower.add_done_callback(self._followers.discard)
                try:
                    async for body in inbox.bodies():
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        tail = (tail + body)[-len(_SSE_DONE_BYTES):]
                except BaseException:
                    follower.cancel()
                    raise
        except Exception as failure:  # the replica died, or the drain cancelled the request
            logger.warning("request to a replica failed: %s", type(failure).__name__)
            if mux:  # its mux broke: the replica may still be running it
                responses.cancel()
            if not accepted and not last_attempt and not self.aborting:
                return False
            error = shut_down() if self.aborting else replica_failed()
            if streaming:
                await send({"type": "http.response.body", "body": _sse_error_end(error), "more_body": False})
            else:
                await _send_error(error, send)
            return True
        if streaming:
            # An event stream whose replica ended it without [DONE] (its app stopped mid-stream
            # without raising, as when it took its request for disconnected) still ends as every
            # stream does: an error event and [DONE], never a bare end.
            end = b""
            if not tail.endswith(_SSE_DONE_BYTES):
                logger.warning("a replica ended an event stream without [DONE]%s",
                               " (draining)" if self.draining else "")
                end = _sse_error_end(shut_down() if self.draining else replica_failed())
            await send({"type": "http.response.body", "body": end, "more_body": False})
        elif start is None:
            await _send_error(replica_failed(), send)
        else:
            await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": False})
        return True

    def abort_all(self) -> None:
        self.aborting = True
        for responses in list(self._in_flight):
            responses.cancel()

    async def close(self) -> None:
        """After the drain: the muxes go too, so that the replicas have nothing in flight."""
        await self.muxes.close()

    async def _replica_labels(self) -> list[str]:
        """The live replicas' labels, as Ray's named actors (the router may not know them all yet)."""
        actors = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        return sorted(a["name"][len(self._replica_name_prefix):] for a in actors
                      if a.get("namespace") == "serve" and a["name"].startswith(self._replica_name_prefix))

    async def open_muxes(self) -> None:
        """At start: a mux to every replica, so that even the first requests' events come muxed
        (a replica missed here gets one when it accepts a request)."""
        try:
            labels = await self._replica_labels()
        except Exception as error:  # Ray's GCS did not answer: the requests will open them
            logger.warning("could not list the replicas: %s", error)
            return
        for label in labels:
            self.muxes.open(label)

    async def replica_metrics(self) -> dict[str, str]:
        """Each live replica's metrics text, asked now (a call pinned to it), by replica label."""
        labels = await self._replica_labels()

        async def one(label: str) -> str | None:
            try:
                return await asyncio.wait_for(self._metrics_handle.remote(Pinned(label)), METRICS_TIMEOUT_S)
            except Exception:  # gone, restarting, or not yet known to the router: no series this time
                return None

        results = await asyncio.gather(*(one(label) for label in labels))
        return {label: text for label, text in zip(labels, results) if text is not None}


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(error: APIError, send: Send) -> None:
    response = error_response(error)

    async def no_receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    await response({"type": "http"}, no_receive, send)


def build_ingress(handle: DeploymentHandle, replica_name_prefix: str, *, api_key: str | None,
                  shutdown_timeout: float, mux_host: str) -> FastAPI:
    """The ingress app; `app.state.drain()` as build_app's (the replicas' requests are what drains)."""
    state = ServerState()
    forwarder = Forwarder(handle, replica_name_prefix, mux_host)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        forwarder.muxes.start()
        await forwarder.open_muxes()
        yield

    app = FastAPI(title="backfill", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.exit = lambda status: None
    app.state.forwarder = forwarder

    async def drain() -> None:
        state.draining = forwarder.draining = True
        deadline = time.monotonic() + shutdown_timeout
        while state.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.num_active:
            logger.warning("grace period over: aborting %d in-flight requests", state.num_active)
            forwarder.abort_all()
            deadline = time.monotonic() + ABORT_FLUSH_S
            while state.num_active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        await forwarder.close()

    app.state.drain = drain

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        return health_response(request.method, dead=False, draining=state.draining)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (merge_metrics(await forwarder.replica_metrics()) + router_metrics(all_decisions())
                + stream_item_metrics(forwarder.muxes.num_items))
        return Response(text, media_type=CONTENT_TYPE)

    app.add_middleware(GateMiddleware, state=state, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    # NOTE: the routes above are the ingress's own; every other path (including unknown ones,
    # which the replica's app answers with its own 404) goes to a replica.
    app.router.default = forwarder  # type: ignore[assignment]
    return app
