"""One multiplexed stream per replica for the streamed bodies of all of an ingress's requests there.

A streamed response sent as one Ray streaming-generator item per chunk costs ~2 ms of CPU per
token across the ingress, the replica and Ray. Instead, the ingress opens one stream to each
replica (EngineReplica.open_mux) and the replica puts every event-stream chunk of that ingress's
requests into its `Outbox`; each Ray item of the mux is then a batch, what was ready at once
(an engine step's tokens for all those requests). A request's own stream still carries
Accepted, ResponseStart and End(num_chunks), and stays open for the request's whole life (Ray
Serve's accounting, the router's in-flight count, cancellation, replica failures: as before).

At the ingress, `Demux` hands each batch's chunks to the requests' `Inbox`es, by stream key. The
two Ray streams are not ordered with each other: an inbox takes chunks before or after its End,
and is complete when End has come and that many chunks. A mux that breaks fails the inboxes bound
to it. No Ray here.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator

Batch = list[tuple[int, bytes]]  # (stream_key, chunk), in the order the replica sent them


class MuxClosed(RuntimeError):
    """The mux carrying a request's chunks broke (its replica died or restarted)."""


class Outbox:
    """A replica's side of one mux: chunks put by its requests, taken as batches."""

    def __init__(self, mux: int) -> None:
        self.mux = mux  # the ingress's id of this mux (Accepted.mux)
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()

    def put(self, stream_key: int, chunk: bytes) -> None:
        self._queue.put_nowait((stream_key, chunk))

    def close(self) -> None:
        """Ends `batches` (a newer mux from the same ingress replaced this one)."""
        self._queue.put_nowait(None)

    async def batches(self) -> AsyncGenerator[Batch, None]:
        """Each time something is put: it and everything else put by then, as one batch."""
        while (first := await self._queue.get()) is not None:
            # NOTE: one turn of the loop first, so the other requests woken by the same engine
            # step put their chunks too: one item for the step, not one per request.
            await asyncio.sleep(0)
            batch, closed = [first], False
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    closed = True
                    break
                batch.append(item)
            yield batch
            if closed:
                return


class Inbox:
    """One muxed request's body at the ingress: chunks from the mux, End from its own stream."""

    def __init__(self) -> None:
        self.mux = 0  # the mux it is bound to, once Accepted came (0: none yet)
        self._chunks: list[bytes] = []
        self._num_expected: int | None = None
        self._failure: Exception | None = None
        self._wake = asyncio.Event()

    def put(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._wake.set()

    def end(self, num_chunks: int) -> None:
        self._num_expected = num_chunks
        self._wake.set()

    def fail(self, failure: Exception) -> None:
        """Ends `bodies` with `failure` once the chunks already here are taken (unless End and
        all its chunks came: then the request is complete and the failure is not its own)."""
        if self._failure is None:
            self._failure = failure
            self._wake.set()

    async def bodies(self) -> AsyncGenerator[bytes, None]:
        """The chunks as they come (those waiting, joined), until End's count is reached; raises
        the failure when one comes first."""
        num_taken = 0
        while True:
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                num_taken += len(chunks)
                yield b"".join(chunks)
                continue
            if self._num_expected is not None and num_taken >= self._num_expected:
                return
            if self._failure is not None:
                raise self._failure
            self._wake.clear()
            await self._wake.wait()


class Demux:
    """The ingress's inboxes by stream key; dispatches the muxes' batches to them."""

    def __init__(self) -> None:
        self._inboxes: dict[int, Inbox] = {}
        self._keys = itertools.count(1)

    def add(self) -> tuple[int, Inbox]:
        """A new request's key and inbox (chunks for it are kept from now on, until `remove`)."""
        key = next(self._keys)
        self._inboxes[key] = inbox = Inbox()
        return key, inbox

    def remove(self, key: int) -> None:
        """The request is over (or its client went away): its late chunks are dropped."""
        self._inboxes.pop(key, None)

    def dispatch(self, batch: Batch) -> None:
        for key, chunk in batch:
            inbox = self._inboxes.get(key)
            if inbox is not None:
                inbox.put(chunk)

    def fail_mux(self, mux: int, failure: Exception) -> None:
        """Mux `mux` broke: every request bound to it fails (the rest of their chunks is lost)."""
        for inbox in self._inboxes.values():
            if inbox.mux == mux:
                inbox.fail(failure)

    def __len__(self) -> int:
        return len(self._inboxes)
