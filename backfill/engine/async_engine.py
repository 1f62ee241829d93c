"""AsyncEngine: drives the synchronous LLMEngine from one background thread for asyncio callers.

```
event loop (HTTP handlers)                         engine thread (owns LLMEngine)
  add_request() ── _Submission ─┐                   ┌─ wait on condition while idle
  abort()      ── request id ───┼─▶ lock+condition ─┤  apply submissions, then aborts
                                │                   │  step() while work remains
  RequestStream ◀── call_soon_threadsafe(_dispatch) ┘  snapshot EngineStats
```

The engine is not thread-safe, so the event loop never touches it: requests and aborts cross
into the engine thread through one lock-protected inbox and are applied between steps; outputs
come back to the loop with `loop.call_soon_threadsafe`, which keeps their order. Each request
gets its own `RequestStream` (an asyncio queue) on the loop side.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from backfill.core.outputs import StepStats
from backfill.outputs import RequestOutput
from backfill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


def load_off_thread(factory: Callable[[], T]) -> T:
    """`factory()` (an engine's loading) run on a short-lived thread; its error is re-raised here.

    Why: libgomp, torch's OpenMP on Linux, keeps a team of worker threads for every thread that
    ran a parallel region, and once it manages more threads than there are CPUs it stops
    spin-waiting between regions, so each of a step's hundreds of parallel regions waits for a
    sleeping worker to wake. Loading a model runs parallel regions (repacking, dequantizing); on
    the main thread its team would outlive the loading beside the engine thread's own, and on a
    2-core machine every step in the server ran 2.3x slower (19 ms against 8 for one stream). A
    thread's team ends with the thread; the engine thread is then the only one computing.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = factory()
        except BaseException as error:  # handed to the caller's thread
            box["error"] = error

    thread = threading.Thread(target=run, name="backfill-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class QueueFullError(Exception):
    """The waiting queue is at its limit: the caller should retry later (HTTP 429)."""


class EngineStoppedError(Exception):
    """The engine no longer admits requests (draining or shut down: HTTP 503)."""


class EngineDeadError(Exception):
    """The engine thread failed; no request can be served any more (HTTP 500)."""


class SyncEngine(Protocol):
    """What AsyncEngine needs from `LLMEngine` (a fake with these members serves tests)."""

    last_step_stats: StepStats | None

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_kv_blocks_used(self) -> int: ...
    @property
    def num_kv_blocks_total(self) -> int: ...
    @property
    def num_preemptions_total(self) -> int: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    group_id: str | None = None) -> None: ...
    def abort_request(self, request_ids: Iterable[str]) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...


class EngineObserver(Protocol):
    """Receives every step's outputs on the event loop (the metrics registry implements it)."""

    def on_step(self, outputs: list[RequestOutput], stats: StepStats | None) -> None: ...
    def on_abort(self, request_ids: list[str]) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, taken by the engine thread between steps."""

    num_running: int = 0  # sequences
    num_waiting: int = 0  # sequences in the engine's waiting queue (includes preempted ones)
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_preemptions_total: int = 0
    num_steps: int = 0

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)


@dataclass
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    group_id: str | None
    accepted: asyncio.Future[None]


class RequestStream:
    """The outputs of one request, in order; ends after the output with `finished=True`.

    Iterate it on the event loop. An engine failure or a forced shutdown ends it by raising
    (`EngineDeadError` / `EngineStoppedError`); an abort ends it quietly. Closing it early
    (`close()`) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, accepted: asyncio.Future[None]) -> None:
        self.request_id = request_id
        self._engine = engine
        self.accepted = accepted  # resolved by the engine thread once the request is queued
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.finished = False  # True once nothing more will be queued
        self._exhausted = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self.finished = isinstance(item, BaseException) or item.finished
        self._queue.put_nowait(item)

    def end(self) -> None:
        """No more outputs (the request was aborted): wake the reader and stop it."""
        if not self.finished:
            self.finished = True
            self._queue.put_nowait(None)

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent."""
        if not self.finished:
            self._engine.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._exhausted:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._exhausted = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._exhausted = True
            raise item
        self._exhausted = item.finished
        return item


class AsyncEngine:
    """Asynchronous front of an `LLMEngine`; every public method runs on the event loop thread.

    `max_queue` bounds the queue: the sequences that are not running yet (waiting in the engine,
    or submitted and not yet picked up by the engine thread) beyond the batch slots free to take
    them. So an idle engine with `max_num_seqs` 4 and `max_queue` 4 accepts a burst of 8 (4 run,
    4 wait) and refuses the rest. At the bound, `add_request` raises `QueueFullError`.
    """

    def __init__(self, engine: SyncEngine, max_queue: int | None = None,
                 observer: EngineObserver | None = None) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._observer = observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # loop side only
        self._admitting = True
        self._dead: BaseException | None = None
        # Shared with the engine thread; guarded by _cond.
        self._cond = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._num_inbox_seqs = 0
        self._num_in_transit_seqs = 0  # taken from the inbox, not yet in a stats snapshot
        self._stop = False
        self._stats = EngineStats()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        assert self._thread is None, "AsyncEngine.start() called twice"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="backfill-engine", daemon=True)
        self._thread.start()

    def stop_admitting(self) -> None:
        """From now on `add_request` raises `EngineStoppedError`; in-flight requests go on."""
        self._admitting = False

    @property
    def num_in_flight(self) -> int:
        """Requests accepted (or being accepted) whose stream has not ended."""
        return len(self._streams)

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def abort_all(self, error: BaseException) -> None:
        """Abort every in-flight request; their streams raise `error`."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)
        self.abort([stream.request_id for stream in streams])

    async def shutdown(self) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._admitting = False
        self.abort_all(EngineStoppedError("the server is shutting down"))
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    # ---- requests ------------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def num_pending_seqs(self) -> int:
        """Sequences not running yet: waiting in the engine, or submitted and not picked up."""
        with self._cond:
            return self._num_inbox_seqs + self._num_in_transit_seqs + self._stats.num_waiting

    def num_queued_seqs(self, num_new_seqs: int = 0) -> int:
        """Pending sequences (plus `num_new_seqs` more) beyond the free batch slots: those that
        have to wait for a slot."""
        with self._cond:
            pending = self._num_inbox_seqs + self._num_in_transit_seqs + self._stats.num_waiting
            num_free_slots = max(self.engine.max_num_seqs - self._stats.num_running, 0)
        return max(pending + num_new_seqs - num_free_slots, 0)

    def check_admission(self, num_seqs: int = 1) -> None:
        """Raise the error `add_request` would raise right now for lack of room or life.

        A request of `num_seqs` sequences needs room in the queue for those that find no free
        slot (capped at the queue's size, so that an `n` larger than `max_queue` is still served
        when nothing queues).
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead!r}")
        if not self._admitting or self._loop is None:
            raise EngineStoppedError("the server is not accepting requests")
        if self.max_queue is not None:
            queued = self.num_queued_seqs()
            needed = min(self.num_queued_seqs(num_seqs) - queued, self.max_queue)
            if queued + needed > self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} sequences wait for a slot)")

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None, group_id: str | None = None) -> RequestStream:
        """Submit a request and wait until the engine thread accepted it (at most one step).

        Requests sharing a `group_id` (the prompts of one HTTP request) share batch slots with
        other groups fairly as one client (see `Scheduler`).

        Raises `ValueError("<field>: ...")` when the engine rejects the input, `QueueFullError`,
        `EngineStoppedError` or `EngineDeadError`. Cancelling the caller aborts the request.
        """
        self.check_admission(params.n)
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        assert self._loop is not None
        accepted: asyncio.Future[None] = self._loop.create_future()
        stream = RequestStream(request_id, self, accepted)
        submission = _Submission(request_id, prompt, params, arrival_time or time.monotonic(), group_id, accepted)
        with self._cond:
            if self._dead is not None:  # checked under the lock: a dead thread never wakes up
                raise EngineDeadError(f"the engine failed: {self._dead!r}")
            self._inbox.append(submission)
            self._num_inbox_seqs += params.n
            self._cond.notify()
        self._streams[request_id] = stream
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Cancel requests: their KV blocks are freed before the engine's next step.

        Unknown or finished ids are ignored; the streams of aborted requests get no more output.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = []
        for request_id in ids:
            # A stream is in _streams exactly while its request lives in the engine.
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.end()
                live.append(request_id)
        if not live:
            return
        with self._cond:
            self._aborts.extend(live)
            self._cond.notify()
        if self._observer is not None:
            self._observer.on_abort(live)

    # ---- loop side of the engine thread --------------------------------------------------

    def _post(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to receive this
            pass

    @staticmethod
    def _resolve(results: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
        for future, error in results:
            if future.done():  # the caller was cancelled; its abort is already queued
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _dispatch(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted since the step began
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
        if self._observer is not None:
            self._observer.on_step(outputs, stats)

    def _fail_all(self, error: BaseException) -> None:
        self._admitting = False
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(error)
            stream.put(error)
        self._streams.clear()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    # NOTE: sleep only when there is nothing to apply and nothing to step;
                    # every producer notifies, so an idle engine costs no CPU.
                    while not (self._inbox or self._aborts or self._stop) and not engine.has_unfinished_requests():
                        self._cond.wait()
                    stop = self._stop
                    submissions, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    self._num_in_transit_seqs += self._num_inbox_seqs
                    self._num_inbox_seqs = 0
                if stop:  # leave the engine clean: apply the last aborts, refuse the rest
                    engine.abort_request(aborts)
                    stopped = EngineStoppedError("the server is shutting down")
                    self._post(self._resolve, [(sub.accepted, stopped) for sub in submissions])
                    self._snapshot(False)
                    break
                results: list[tuple[asyncio.Future[None], BaseException | None]] = []
                for sub in submissions:
                    try:
                        engine.add_request(sub.request_id, sub.prompt, sub.params, arrival_time=sub.arrival_time,
                                           group_id=sub.group_id)
                        results.append((sub.accepted, None))
                    except ValueError as error:
                        results.append((sub.accepted, error))
                    except Exception as error:  # a bug hit by one input must not stop the engine
                        logger.exception("engine rejected request %s", sub.request_id)
                        engine.abort_request([sub.request_id])
                        results.append((sub.accepted, error))
                # Aborts after adds: an abort may target a request submitted in the same batch.
                if aborts:
                    engine.abort_request(aborts)
                if results:
                    self._post(self._resolve, results)
                outputs: list[RequestOutput] = []
                stats: StepStats | None = None
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    stats = engine.last_step_stats
                self._snapshot(stats is not None)
                if outputs or stats is not None:
                    self._post(self._dispatch, outputs, stats)
        except BaseException as error:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine thread failed")
            with self._cond:
                self._dead = error
                self._inbox.clear()
            # Every submitted request has a stream on the loop side: failing the streams also
            # fails the submissions still waiting for acceptance.
            self._post(self._fail_all, EngineDeadError(f"the engine failed: {error!r}"))

    def _snapshot(self, stepped: bool) -> None:
        engine = self.engine
        stats = EngineStats(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_kv_blocks_used=engine.num_kv_blocks_used,
            num_kv_blocks_total=engine.num_kv_blocks_total,
            num_preemptions_total=engine.num_preemptions_total,
            num_steps=self._stats.num_steps + int(stepped),
        )
        with self._cond:
            self._stats = stats
            self._num_in_transit_seqs = 0
