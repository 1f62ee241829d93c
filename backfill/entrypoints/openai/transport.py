"""What uvicorn's HTTP layer does not do for us: a read timeout, and secrets out of the access log.

uvicorn closes idle keep-alive connections (5 s), but a connection that never finishes its
request (a slowloris client sending a header byte a minute, or a body that never ends) is
held forever, and so is one that connects and sends nothing. `ReadTimeoutHttpProtocol` gives
every request `read_timeout` seconds to arrive whole, headers and body, counted from the
connection or from the end of the previous response; then the connection is closed (an
unfinished body reaches the app as a disconnect, which aborts nothing since nothing was
queued yet).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import unquote_plus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 30.0


class ReadTimeoutHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request (headers and body).

    Use `functools.partial(ReadTimeoutHttpProtocol, read_timeout=...)` as uvicorn's `http`.
    httptools (llhttp, in C), not h11: h11 parsed and framed every streamed chunk in Python, a
    third of the front end's CPU time under a streaming load (measured with py-spy).
    """

    def __init__(self, *args: Any, read_timeout: float = DEFAULT_READ_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_deadline: asyncio.TimerHandle | None = None
        # The cycle that was current when the deadline was armed: a *new* one that has all its
        # body is the request the deadline waited for.
        self._armed_cycle: RequestResponseCycle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._armed_cycle = self.cycle
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            logger.info("closing a connection whose request did not arrive within %.0f s", self.read_timeout)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self.cycle
        if self._read_deadline is not None and cycle is not None and cycle is not self._armed_cycle \
                and not cycle.more_body:
            self._disarm()  # the whole request is in; the response may take as long as it takes

    def on_response_complete(self) -> None:
        # The next request on this connection gets its own read_timeout. Armed first: a
        # pipelined request that uvicorn handles inside the call may already be complete.
        self._arm()
        super().on_response_complete()
        if self.transport.is_closing():
            self._disarm()


SECRET_QUERY_PARAMETERS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token",
                                     "auth", "password", "secret"})


def redact_query(path: str) -> str:
    """`/v1/models?api_key=sk-1&x=2` -> `/v1/models?api_key=***&x=2`, for secret-named parameters."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}=***" if eq and unquote_plus(name).lower() in SECRET_QUERY_PARAMETERS else item)
    return base + sep + "&".join(parts)


class RedactSecretsFilter(logging.Filter):
    """On uvicorn's access logger: credentials passed in the query string are logged as ***.

    The server reads its key only from the Authorization header, but clients put keys in URLs
    all the same, and access logs are read by many more people than the key was meant for.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn logs '%s - "%s %s HTTP/%s" %d' with (client, method, path?query, version, status).
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True
