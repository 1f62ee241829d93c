"""One multiplexed stream per replica for the streamed bodies of all of an ingress's requests there.

A streamed response sent as one Ray streaming-generator item per chunk costs ~2 ms of CPU per
token across the ingress, the replica and Ray; even one Ray item per engine step (a batch) costs
the ingress a gRPC call, a deserialization on Ray's IO thread and two hand-offs between threads.
So the events travel outside Ray: the ingress binds one ZMQ PULL socket (`MuxReceiver`) and
each replica it opens a mux on (EngineReplica.open_mux) connects a PUSH socket to it
(`MuxSender`); every event-stream chunk of that ingress's requests goes into the replica's
`Outbox`, and each ZMQ message is a batch, what was ready at once (an engine step's tokens for
all those requests), with the replica's load (running + waiting sequences) when it was sent.

Ray still carries everything else. The mux call itself is a Ray stream that yields nothing and
stays open while the replica lives, so a replica that dies breaks it as before. A request's own
stream carries Accepted, ResponseStart and End(num_chunks), and stays open for the request's
whole life (Ray Serve's accounting, the router's in-flight count, cancellation, replica
failures).

At the ingress, `Demux` hands each batch's chunks to the requests' `Inbox`es, by stream key. The
mux and a request's own stream are not ordered with each other: an inbox takes chunks before or
after its End. It is complete when the mux brings the stream's end (the replica puts it after
the last chunk), or when End has come and that many chunks. A mux that breaks fails the inboxes
bound to it. No Ray here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable

import msgspec
import zmq

from backfill.engine.core_process import receive_ready

logger = logging.getLogger(__name__)

# (stream_key, chunk), in the order the replica sent them; chunk None: that stream's last (its
# body is complete: the ingress ends the response without waiting for End).
Batch = list[tuple[int, bytes | None]]
# How long a closed sender keeps trying to deliver what it has queued (its mux was replaced or
# cancelled: the requests still waiting for those chunks are failed by then, or about to be).
SENDER_LINGER_MS = 1000
# The largest message the ingress's socket takes: a replica's batch is one engine step's chunks
# for at most its max_num_seqs streams (a few KB each, top logprobs included), far below this.
# A larger one is not from a replica: ZMQ disconnects its peer while reading it, before it is
# held whole in memory (anyone who can reach the port may connect; the token check comes after).
MAX_MESSAGE_BYTES = 256 * 2**20


class MuxMessage(msgspec.Struct, array_like=True):
    """One ZMQ message of a mux: a batch of chunks, from the replica of the ingress's mux `mux`.
    `token`: the ingress's mux id (a message without it is not from one of its replicas)."""

    token: str
    mux: int
    load: int  # the replica's engine: running + waiting sequences
    chunks: Batch


class MuxClosed(RuntimeError):
    """The mux carrying a request's chunks broke (its replica died or restarted)."""


class Outbox:
    """A replica's side of one mux: chunks put by its requests, taken as batches."""

    def __init__(self, mux: int) -> None:
        self.mux = mux  # the ingress's id of this mux (Accepted.mux)
        self._queue: asyncio.Queue[tuple[int, bytes | None] | None] = asyncio.Queue()

    def put(self, stream_key: int, chunk: bytes | None) -> None:
        """A chunk of the stream `stream_key`; None after its last."""
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
    """One muxed request's body at the ingress: chunks from the mux, End from its own stream.
    Complete at the mux's end of the stream, or when End has come and that many chunks."""

    def __init__(self) -> None:
        self.mux = 0  # the mux it is bound to, once Accepted came (0: none yet)
        self._chunks: list[bytes] = []
        self._num_expected: int | None = None
        self._complete = False  # the mux said so
        self._failure: Exception | None = None
        self._wake = asyncio.Event()

    def put(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._wake.set()

    def end(self, num_chunks: int) -> None:
        self._num_expected = num_chunks
        self._wake.set()

    def complete(self) -> None:
        """The mux's end of this stream: every chunk before it in the mux is here."""
        self._complete = True
        self._wake.set()

    def fail(self, failure: Exception) -> None:
        """Ends `bodies` with `failure` once the chunks already here are taken (unless the body
        is complete: then the failure is not the request's own)."""
        if self._failure is None:
            self._failure = failure
            self._wake.set()

    async def bodies(self) -> AsyncGenerator[bytes, None]:
        """The chunks as they come (those waiting, joined), until the body is complete; raises
        the failure when one comes first."""
        num_taken = 0
        while True:
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                num_taken += len(chunks)
                yield b"".join(chunks)
                continue
            if self._complete or (self._num_expected is not None and num_taken >= self._num_expected):
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
                if chunk is None:
                    inbox.complete()
                else:
                    inbox.put(chunk)

    def fail_mux(self, mux: int, failure: Exception) -> None:
        """Mux `mux` broke: every request bound to it fails (the rest of their chunks is lost)."""
        for inbox in self._inboxes.values():
            if inbox.mux == mux:
                inbox.fail(failure)

    def __len__(self) -> int:
        return len(self._inboxes)


class MuxSender:
    """A replica's end of the ZMQ channel of one mux (used on the replica's event loop only)."""

    def __init__(self, address: str, token: str, mux: int) -> None:
        self._token, self._mux = token, mux
        self._encoder = msgspec.msgpack.Encoder()
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        # NOTE: no high-water mark: a send never blocks nor drops (what the ingress is slow to
        # take waits here, as it did in Ray's stream); a PUSH socket that connects queues from
        # the start, before the connection is made.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, SENDER_LINGER_MS)
        self._socket.connect(address)

    def send(self, batch: Batch, load: int) -> None:
        message = MuxMessage(self._token, self._mux, load, batch)
        self._socket.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._socket.close()


class MuxReceiver:
    """The ingress's end: one PULL socket for the muxes to all replicas, read on the running
    loop; `on_message(mux, load, batch)` for each message that carries `token`."""

    def __init__(self, host: str, token: str, on_message: Callable[[int, int, Batch], None],
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._token = token
        self._on_message = on_message
        self._decoder = msgspec.msgpack.Decoder(MuxMessage)
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = 0

    def start(self) -> None:
        """Read on the running loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._fd = self._socket.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._readable)
        self._readable()

    def _readable(self) -> None:
        receive_ready(self._socket, self._on_frame, "a mux batch")

    def _on_frame(self, buffer: memoryview) -> None:
        try:
            message = self._decoder.decode(buffer)
        except msgspec.DecodeError:
            logger.warning("a message on the muxes' socket is not a mux batch: dropped")
            return
        if message.token != self._token:
            logger.warning("a mux batch for another ingress: dropped")
            return
        self._on_message(message.mux, message.load, message.chunks)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None
        self._socket.close()
