"""AsyncEngine: the server's front end of an `EngineCore` that runs in a process of its own.

```
event loop (HTTP handlers)                                      core process (core_process.py)
  add_request() ─ InputProcessor (validate, n -> sequences) ─┐
  abort()       ─ OutputProcessor.abort -> core ids ─────────┼─ CoreInputs ──▶ EngineCore
  RequestStream ◀─ OutputProcessor (detokenize, stop strings) ◀─ CoreOutputs ─┘ busy loop
                       └─ sequences a stop string ended ─ CoreInputs(abort) ──▶
```

Everything here runs on the event loop: requests go to the core as plain messages the moment
they are accepted, and each message from the core is turned into `RequestOutput`s and queued on
the `RequestStream` of its request (an asyncio queue), in order. The core's death (a crash, the
OOM killer, `kill -9`) fails every stream with `EngineDeadError` at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import msgspec

from backfill.core.outputs import StepStats
from backfill.engine.core_process import CoreProcess
from backfill.engine.messages import CoreInfo, CoreInputs, CoreLoad, CoreOutputs
from backfill.engine.output_processor import OutputProcessor
from backfill.engine.processor import InputProcessor
from backfill.tokenizer import Tokenizer
from backfill.outputs import RequestOutput
from backfill.request import FinishReason
from backfill.sampling_params import SamplingParams

_TIMEOUT = FinishReason.TIMEOUT.value  # NOTE: an Enum's .value is a property: read it once
_CONSTRAINT = FinishReason.CONSTRAINT.value
logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its limit: the caller should retry later (HTTP 429)."""


class EngineError(Exception):
    """A request the engine cannot serve to its end, for the engine's sake, not the input's."""


class EngineStoppedError(EngineError):
    """The engine no longer admits requests (draining or shut down: HTTP 503)."""


class EngineDeadError(EngineError):
    """The engine core died; no request can be served any more (HTTP 500)."""


class RequestTimeoutError(EngineError):
    """The request's deadline passed before it finished; the core has freed it (HTTP 408)."""


class ConstraintFailedError(EngineError):
    """The request's output constraint could not be met: the grammar engine gave up on it or no
    token it allows could be sampled (HTTP 400: the request asked for it)."""


class RequestFailedError(EngineError):
    """The core could not take one request (a defect: the front end validates first; HTTP 500)."""


class EngineObserver(Protocol):
    """Receives every step's outputs on the event loop (the metrics registry and the dashboard's
    LiveStats implement it)."""

    def on_step(self, outputs: list[RequestOutput], stats: StepStats | None) -> None: ...
    def on_abort(self, request_ids: list[str]) -> None: ...


class RequestStream:
    """The outputs of one request, in order; ends after the output with `finished=True`.

    Iterate it on the event loop. An engine failure, a forced shutdown or the request's deadline
    ends it by raising (`EngineDeadError` / `EngineStoppedError` / `RequestTimeoutError`), an
    output constraint that cannot be met by raising `ConstraintFailedError`; an abort ends it
    quietly. Closing it early (`close()`) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.finished = False  # True once nothing more will be queued
        self._exhausted = False
        self.num_cached_tokens = 0  # of its prompt, from the prefix cache (for usage)

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self.finished = isinstance(item, BaseException) or item.finished
        if not isinstance(item, BaseException):
            self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
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
    """Asynchronous front of an engine core process; every method runs on the event loop thread.

    `max_queue` bounds the queue: the sequences that are not running yet (waiting in the core,
    or sent and not yet taken in by it) beyond the batch slots free to take them. So an idle
    engine with `max_num_seqs` 4 and `max_queue` 4 accepts a burst of 8 (4 run, 4 wait) and
    refuses the rest. At the bound, `add_request` raises `QueueFullError`.
    """

    def __init__(self, core: CoreProcess, info: CoreInfo, tokenizer: Tokenizer, max_queue: int | None = None,
                 observers: Sequence[EngineObserver] = ()) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.core = core
        self.info = info
        self.max_queue = max_queue
        self._observers = tuple(observers)
        self._processor = InputProcessor(tokenizer, info)
        self._output_processor = OutputProcessor(tokenizer.hf)
        self._streams: dict[str, RequestStream] = {}
        self._started = False
        self._admitting = True
        self._dead: EngineDeadError | None = None
        self._load = CoreLoad(num_kv_blocks_total=info.num_kv_blocks)
        self._num_in_transit_seqs = 0  # sent to the core, not yet counted in a CoreLoad
        # Called once, on the loop, when the core dies (the server schedules its exit).
        self.on_death: Callable[[], None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start taking the core's messages; call from the event loop that serves requests."""
        assert not self._started, "AsyncEngine.start() called twice"
        self._started = True
        self.core.attach(self._on_outputs, self._on_death)

    def stop_admitting(self) -> None:
        """From now on `add_request` raises `EngineStoppedError`; in-flight requests go on."""
        self._admitting = False

    @property
    def num_in_flight(self) -> int:
        """Requests accepted whose stream has not ended."""
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
        """Abort what is left, stop the core process and wait for it."""
        self._admitting = False
        self.abort_all(EngineStoppedError("the server is shutting down"))
        await self.core.shutdown()

    # ---- requests ------------------------------------------------------------------------

    @property
    def stats(self) -> CoreLoad:
        """The core's load as of its last message."""
        return self._load

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def num_pending_seqs(self) -> int:
        """Sequences not running yet: waiting in the core, or sent and not taken in yet."""
        return self._num_in_transit_seqs + self._load.num_waiting

    def num_queued_seqs(self, num_new_seqs: int = 0) -> int:
        """Pending sequences (plus `num_new_seqs` more) beyond the free batch slots: those that
        have to wait for a slot."""
        num_free_slots = max(self.info.max_num_seqs - self._load.num_running, 0)
        return max(self.num_pending_seqs() + num_new_seqs - num_free_slots, 0)

    def check_admission(self, num_seqs: int = 1) -> None:
        """Raise the error `add_request` would raise right now for lack of room or life.

        A request of `num_seqs` sequences needs room in the queue for those that find no free
        slot (capped at the queue's size, so that an `n` larger than `max_queue` is still served
        when nothing queues).
        """
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._admitting or not self._started:
            raise EngineStoppedError("the server is not accepting requests")
        if self.max_queue is not None:
            queued = self.num_queued_seqs()
            needed = min(self.num_queued_seqs(num_seqs) - queued, self.max_queue)
            if queued + needed > self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} sequences wait for a slot)")

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None, group_id: str | None = None, priority: int = 0,
                          deadline: float | None = None) -> RequestStream:
        """Validate a request and send it to the core; its outputs arrive on the stream.

        Requests sharing a `group_id` (the prompts of one HTTP request) share batch slots with
        other groups fairly as one client (see `Scheduler`). `priority` and `deadline`: see
        `InputProcessor.process`; a request past its deadline ends its stream with
        `RequestTimeoutError`.

        Raises `ValueError("<field>: ...")` for input the engine can't serve, `QueueFullError`,
        `EngineStoppedError` or `EngineDeadError`.
        """
        self.check_admission(params.n)
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = self._processor.process(request_id, prompt, params, arrival_time or time.monotonic(),
                                          group_id=group_id, priority=priority, deadline=deadline)
        self._output_processor.add(request)
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._num_in_transit_seqs += len(request.sequences)
        try:
            self.core.send(CoreInputs(add=request.sequences))
        except BaseException as error:
            # Nothing reached the core: forget the request, or it would count as waiting forever
            # (and hold its share of --max-queue).
            self._streams.pop(request_id, None)
            self._num_in_transit_seqs -= len(request.sequences)
            self._output_processor.abort(request_id)
            if isinstance(error, (OverflowError, msgspec.EncodeError)):
                # msgpack holds integers in [-2**63, 2**64 - 1]; a field the checks let through
                # (a number inside a JSON schema) can be larger
                raise ValueError(f"a number in the request is out of range ({error})") from None
            raise
        return stream

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Cancel requests: their KV blocks are freed before the core's next step.

        Unknown or finished ids are ignored; the streams of aborted requests get no more output.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live: list[str] = []
        core_ids: list[str] = []
        for request_id in ids:
            # A stream is in _streams exactly while its request lives in the engine.
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.end()
                live.append(request_id)
                core_ids.extend(self._output_processor.abort(request_id))
        if not live:
            return
        if self._dead is None:
            self.core.send(CoreInputs(abort=core_ids))
        for observer in self._observers:
            observer.on_abort(live)

    # ---- messages from the core ----------------------------------------------------------

    def _on_outputs(self, message: CoreOutputs) -> None:
        self._load = message.load
        self._num_in_transit_seqs = max(self._num_in_transit_seqs - message.num_added, 0)
        for core_id, why in message.refused:
            stream = self._streams.get(self._output_processor.request_of(core_id) or "")
            if stream is not None:
                stream.put(RequestFailedError(f"the engine could not take the request: {why}"))
                self.abort(stream.request_id)
        outputs, stopped = self._output_processor.process(message.outputs)
        if stopped:
            self.core.send(CoreInputs(abort=stopped))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted since the step began
                continue
            failure = _failure(output)
            if failure is not None:
                stream.put(failure)
                del self._streams[output.request_id]
                core_ids = self._output_processor.abort(output.request_id)  # its other sequences, if live
                if core_ids:
                    self.core.send(CoreInputs(abort=core_ids))
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
        if outputs or message.stats is not None:
            for observer in self._observers:
                observer.on_step(outputs, message.stats)

    def _on_death(self, why: str) -> None:
        logger.error("the engine core died: %s", why)
        self._dead = EngineDeadError(f"the engine failed: {why}")
        self._admitting = False
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(str(self._dead)))
        self._streams.clear()
        if self.on_death is not None:
            self.on_death()


def _failure(output: RequestOutput) -> EngineError | None:
    """The error that ends a request instead of its output (a sequence finished TIMEOUT or
    CONSTRAINT), or None."""
    reasons = {c.finish_reason for c in output.outputs}
    if _TIMEOUT in reasons:
        return RequestTimeoutError("the request did not finish before its deadline (request_timeout)")
    if _CONSTRAINT in reasons:
        return ConstraintFailedError(
            "the output constraint could not be met: the grammar engine gave up on it within its limits, "
            "the schema or grammar admits no output, or other settings (allowed_token_ids, bad_words, "
            "min_tokens, logit_bias) leave no token it allows")
    return None
