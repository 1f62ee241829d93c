"""One HTTP request handed to an ASGI app in-process, the response coming back as plain data.

This is how a Ray Serve replica runs the single server's very app (api_server.build_app) on a
request the ingress forwarded: the same routes, auth gate, errors and streaming. No Ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message

# After a caller stops reading (its client went away): how long the app gets to see the
# disconnect and abort its engine requests before it is cancelled.
DISCONNECT_GRACE_S = 2.0


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress read it; `routing_text` is the prompt's text, for the router."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    routing_text: str = ""
    mux_id: str = ""  # the ingress's: where the replica may send the streamed body (mux.py)
    stream_key: int = 0  # this request's chunks in that mux


@dataclass(frozen=True)
class Accepted:
    """What a replica sends first: from here on the request is its own (a failure is the
    client's error, not a reason to try another replica). `mux`: the id of the ingress's mux
    to this replica that will carry the request's event-stream body (0: it comes inline)."""

    replica: str = ""
    mux: int = 0


@dataclass(frozen=True)
class End:
    """A muxed request's last item: how many body chunks it sent through the mux."""

    num_chunks: int


@dataclass(frozen=True)
class Pinned:
    """A call's first argument naming the replica it must go to (router.BackfillRouter): the
    replica's other methods than __call__ (its mux, its metrics)."""

    replica: str


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class BodyEnd:
    """What call_app yields once the app has sent its body's last message (BODY_END)."""

    def __repr__(self) -> str:
        return "BODY_END"


BODY_END = BodyEnd()


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's body is server-sent events (passed on as it comes, and muxed)."""
    return dict(headers).get(b"content-type", b"").startswith(b"text/event-stream")


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncGenerator[ResponseStart | bytes | BodyEnd, None]:
    """Run `request` through `app`: yields a ResponseStart, then the body's chunks as sent (those
    sent while the previous one was being passed on, joined), then BODY_END as soon as the app
    has sent the body's end (before it returns: the body is complete, whatever the app does next).

    Closing the generator early (the ingress's client disconnected) is a disconnect for the app.
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_taken = False

    async def receive() -> Message:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query_string, "root_path": "", "headers": request.headers,
             "client": request.client, "server": ("127.0.0.1", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
                continue
            # NOTE: the chunks already waiting go as one: under load, fewer and larger items
            # cross Ray (a stream's events stay whole and in order).
            body, more, ended = [message.get("body", b"")], message.get("more_body", False), False
            while more and not messages.empty():
                queued = messages.get_nowait()
                if queued is None:  # the app returned mid-body
                    ended = True
                    break
                body.append(queued.get("body", b""))
                more = queued.get("more_body", False)
            if any(body):
                yield b"".join(body)
            if not more and not ended:
                yield BODY_END
            if ended or not more:
                break
        await task  # raises what the app raised (it sends its own error responses for the rest)
    finally:
        if not task.done():
            disconnected.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            task.cancel()
