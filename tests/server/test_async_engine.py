"""AsyncEngine against a fake synchronous engine: ordering, abort, admission, failure, shutdown.

The fake follows LLMEngine's contract (one token per running request per step, `ValueError`
naming the field, outputs only for requests that changed, nothing after an abort) and asserts
that it is only ever called from one thread, which is the AsyncEngine's core promise.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable

import pytest

from backfill.core.outputs import StepStats
from backfill.engine.async_engine import (AsyncEngine, EngineDeadError, EngineStoppedError,
                                          QueueFullError, load_off_thread)
from backfill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from backfill.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self, max_running: int = 4, step_time: float = 0.002, fail_at_step: int | None = None) -> None:
        self.max_running = max_running
        self.step_time = step_time
        self.fail_at_step = fail_at_step
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.state: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.num_steps = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.last_step_stats: StepStats | None = None
        self.num_preemptions_total = 0
        self.num_kv_blocks_total = 100

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())
        assert len(self.thread_ids) == 1, "engine called from two threads"

    @property
    def max_num_seqs(self) -> int:
        return self.max_running

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_kv_blocks_used(self) -> int:
        return len(self.running)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, group_id: str | None = None) -> None:
        self._touch()
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if request_id in self.state:
            raise ValueError("request_id: duplicate")
        self.state[request_id] = (list(prompt) if isinstance(prompt, list) else [1], params, [])
        self.waiting.append(request_id)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        self._touch()
        for request_id in request_ids:
            if request_id in self.state:
                del self.state[request_id]
                self.aborted.append(request_id)
                for queue in (self.waiting, self.running):
                    if request_id in queue:
                        queue.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.state)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_time)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        outputs = []
        for request_id in list(self.running):
            prompt, params, tokens = self.state[request_id]
            tokens.append(len(tokens))
            done = params.max_tokens is not None and len(tokens) >= params.max_tokens
            completion = CompletionOutput(index=0, text=" ".join(map(str, tokens)), token_ids=list(tokens),
                                          finish_reason="length" if done else None,
                                          delta_text=f" {tokens[-1]}", delta_token_ids=[tokens[-1]])
            outputs.append(RequestOutput(request_id, None, prompt, [completion], done,
                                         RequestMetrics(arrival_time=0.0, first_token_time=1.0, last_token_time=1.0)))
            if done:
                self.running.remove(request_id)
                del self.state[request_id]
        return outputs


def params(max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


async def collect(stream: object) -> list[RequestOutput]:
    return [output async for output in stream]  # type: ignore[attr-defined]


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Wait for something the engine thread guarantees to do eventually. NOTE: the timeout
    only ends a broken test; a loaded machine may take many times longer than an idle one."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def test_many_requests_stream_in_order_and_finish() -> None:
    async def main() -> None:
        fake = FakeEngine(max_running=3)
        engine = AsyncEngine(fake)
        engine.start()
        streams = [await engine.add_request(f"r{i}", [1, 2], params(2 + i % 4)) for i in range(10)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for i, outputs in enumerate(results):
            assert [o.outputs[0].token_ids[-1] for o in outputs] == list(range(2 + i % 4))
            assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert engine.num_in_flight == 0
        await engine.shutdown()
        assert len(fake.thread_ids) == 1

    run(main())


def test_engine_rejection_is_raised_by_add_request() -> None:
    async def main() -> None:
        engine = AsyncEngine(FakeEngine())
        engine.start()
        with pytest.raises(ValueError, match="^prompt: "):
            await engine.add_request("bad", [], params())
        assert engine.num_in_flight == 0
        # The same id can be used again once rejected, and duplicates in flight are refused.
        stream = await engine.add_request("bad", [1], params(50))
        with pytest.raises(ValueError, match="^request_id: "):
            await engine.add_request("bad", [1], params())
        stream.close()
        await engine.shutdown()

    run(main())


def test_abort_mid_stream_frees_the_request_and_ends_the_stream() -> None:
    async def main() -> None:
        fake = FakeEngine(step_time=0.01)
        engine = AsyncEngine(fake)
        engine.start()
        stream = await engine.add_request("a", [1], params(10_000))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                stream.close()
        assert seen >= 3
        assert await until(lambda: engine.stats.num_running == 0 and "a" in fake.aborted)
        assert fake.aborted == ["a"] and engine.stats.num_running == 0 and engine.stats.num_kv_blocks_used == 0
        await engine.shutdown()

    run(main())


def test_cancelled_submitter_aborts_its_request() -> None:
    async def main() -> None:
        fake = FakeEngine(step_time=0.05)
        engine = AsyncEngine(fake)
        engine.start()
        keep = await engine.add_request("busy", [1], params(10_000))  # keeps the thread stepping
        task = asyncio.create_task(engine.add_request("gone", [1], params(10_000)))
        await asyncio.sleep(0)  # submitted, not yet accepted (the thread is mid-step)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await until(lambda: "gone" in fake.aborted)
        assert "busy" not in fake.aborted
        keep.close()
        await engine.shutdown()

    run(main())


def test_queue_limit_counts_waiting_and_not_yet_picked_up() -> None:
    async def main() -> None:
        fake = FakeEngine(max_running=1, step_time=0.02)
        engine = AsyncEngine(fake, max_queue=2)
        engine.start()
        first = await engine.add_request("r0", [1], params(10_000))
        assert await until(lambda: engine.stats.num_running == 1)  # r0 runs: it does not queue
        waiting = [await engine.add_request(f"r{i}", [1], params(10_000)) for i in (1, 2)]
        assert engine.num_queued_seqs() == 2
        with pytest.raises(QueueFullError):
            await engine.add_request("r3", [1], params())
        with pytest.raises(QueueFullError):
            engine.check_admission()
        waiting[0].close()
        assert await until(lambda: engine.num_queued_seqs() < 2)
        third = await engine.add_request("r3", [1], params(10_000))
        for stream in (first, waiting[1], third):
            stream.close()
        await engine.shutdown()

    run(main())


def test_queue_counts_only_what_finds_no_free_slot() -> None:
    # An idle engine with 4 slots and --max-queue 4 takes a burst of 8 (4 run, 4 wait) and
    # refuses what comes beyond, however the engine thread interleaves with the submissions:
    # sequences in the inbox, in transit and in the engine all count, and so do free slots.
    async def main() -> None:
        fake = FakeEngine(max_running=4, step_time=0.01)
        engine = AsyncEngine(fake, max_queue=4)
        engine.start()
        results = await asyncio.gather(*(engine.add_request(f"r{i}", [1], params(10_000)) for i in range(12)),
                                       return_exceptions=True)
        accepted = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(accepted) == 8 and len(refused) == 4 and all(isinstance(r, QueueFullError) for r in refused)
        assert engine.num_queued_seqs() == 4 and engine.num_pending_seqs() in (4, 8)
        with pytest.raises(QueueFullError):  # n=2: both would queue
            engine.check_admission(2)
        for stream in accepted:
            stream.close()  # type: ignore[union-attr]
        await engine.shutdown()

    run(main())


def test_idle_engine_does_not_step() -> None:
    async def main() -> None:
        fake = FakeEngine()
        engine = AsyncEngine(fake)
        engine.start()
        await collect(await engine.add_request("a", [1], params(3)))
        steps = fake.num_steps
        await asyncio.sleep(0.3)
        assert fake.num_steps == steps
        await engine.shutdown()

    run(main())


def test_engine_failure_fails_streams_and_new_requests() -> None:
    async def main() -> None:
        engine = AsyncEngine(FakeEngine(fail_at_step=3))
        engine.start()
        stream = await engine.add_request("a", [1], params(100))
        with pytest.raises(EngineDeadError):
            await collect(stream)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], params())
        await engine.shutdown()

    run(main())


def test_drain_then_shutdown() -> None:
    async def main() -> None:
        fake = FakeEngine(step_time=0.01)
        engine = AsyncEngine(fake)
        engine.start()
        short = await engine.add_request("short", [1], params(3))
        endless = await engine.add_request("endless", [1], params(10_000))
        engine.stop_admitting()
        with pytest.raises(EngineStoppedError):
            await engine.add_request("late", [1], params())
        assert len(await collect(short)) == 3  # in-flight requests go on while draining
        assert not await engine.wait_until_idle(0.1)
        engine.abort_all(EngineStoppedError("grace over"))
        with pytest.raises(EngineStoppedError):
            await collect(endless)
        assert await engine.wait_until_idle(60.0)  # at once: the abort ended every stream
        await engine.shutdown()
        assert "endless" in fake.aborted and not fake.state

    run(main())


def test_load_off_thread_returns_the_value_from_another_thread_and_reraises_errors() -> None:
    caller = threading.get_ident()
    loaded_on: list[int] = []

    def load() -> str:
        loaded_on.append(threading.get_ident())
        return "engine"

    assert load_off_thread(load) == "engine"
    assert loaded_on and loaded_on[0] != caller  # not the caller's thread (its OpenMP team would stay)

    def fail() -> None:
        raise ValueError("model: no such file")

    with pytest.raises(ValueError, match="model: no such file"):
        load_off_thread(fail)
