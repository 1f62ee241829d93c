"""AsyncEngine over a fake core in a real core process: ordering, abort, admission, stop strings,
failure and death of the core, shutdown, and no core process outliving its front end.

The fake core (`fake_core.py`) samples token 100, 101, ... (text "t", "u", ...) for every
running sequence, one per step.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from backfill.engine.async_engine import (AsyncEngine, EngineDeadError, EngineStoppedError, QueueFullError,
                                          RequestFailedError, RequestTimeoutError)
from backfill.engine.core_process import FOLDER_PREFIX, CoreProcess, CoreStartError, remove_stale_folders
from backfill.engine.messages import CoreInputs
from backfill.tokenizer import Tokenizer, load_tokenizer
from backfill.outputs import RequestOutput
from backfill.sampling_params import SamplingParams
from tests.server.fake_core import failing_factory, start_fake_core
from tests.server.harness import is_alive


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def params(max_tokens: int = 5, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


async def collect(stream: object) -> list[RequestOutput]:
    return [output async for output in stream]  # type: ignore[attr-defined]


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Wait for something the core guarantees to do eventually. NOTE: the timeout only ends a
    broken test; a loaded machine may take many times longer than an idle one."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def run_engine(tokenizer: Tokenizer, test: Callable[[AsyncEngine], Any], max_queue: int | None = None,
               **core_kwargs: Any) -> None:
    """Start a fake core process, run `test(engine)` on an event loop, shut everything down."""
    core, info = start_fake_core(**core_kwargs)

    async def main() -> None:
        engine = AsyncEngine(core, info, tokenizer, max_queue=max_queue)
        engine.start()
        try:
            await test(engine)
        finally:
            await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        core.close()
    assert not core.process.is_alive()  # type: ignore[union-attr]


def test_many_requests_stream_in_order_and_finish(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        streams = [await engine.add_request(f"r{i}", [1, 2], params(2 + i % 4)) for i in range(10)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for i, outputs in enumerate(results):
            assert [o.outputs[0].token_ids[-1] for o in outputs] == [100 + k for k in range(2 + i % 4)]
            assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
            assert outputs[-1].outputs[0].text == "tuvwxyz"[: 2 + i % 4]
            assert outputs[-1].outputs[0].finish_reason == "length"
        assert engine.num_in_flight == 0

    run_engine(tokenizer, test, max_running=3)


def test_n_sequences_fan_in_to_one_request(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        outputs = await collect(await engine.add_request("r", [1], params(3, n=3)))
        assert outputs[-1].finished
        last = {c.index: c for output in outputs for c in output.outputs}
        assert sorted(last) == [0, 1, 2] and all(c.token_ids == [100, 101, 102] for c in last.values())

    run_engine(tokenizer, test)


def test_invalid_input_is_refused_before_it_reaches_the_core(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="^prompt: "):
            await engine.add_request("bad", [], params())
        with pytest.raises(ValueError, match="^prompt: token id 49152 is outside"):
            await engine.add_request("bad", [49152], params())
        assert engine.num_in_flight == 0
        # The same id can be used again once refused, and duplicates in flight are refused.
        stream = await engine.add_request("bad", [1], params(50))
        with pytest.raises(ValueError, match="^request_id: "):
            await engine.add_request("bad", [1], params())
        stream.close()

    run_engine(tokenizer, test)


def test_abort_mid_stream_frees_the_request_and_ends_the_stream(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        stream = await engine.add_request("a", [1], params(10_000))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                stream.close()
        assert seen >= 3
        assert await until(lambda: engine.stats.num_running == 0 and engine.stats.num_kv_blocks_used == 0)
        assert engine.num_in_flight == 0

    run_engine(tokenizer, test, step_time=0.01)


def test_stop_string_ends_the_sequence_and_aborts_it_in_the_core(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        outputs = await collect(await engine.add_request("s", [1], params(10_000, stop=["wx"])))
        final = outputs[-1].outputs[0]
        assert final.text == "tuv" and final.finish_reason == "stop" and final.stop_reason == "wx"
        assert await until(lambda: engine.stats.num_running == 0 and engine.stats.num_waiting == 0)

    run_engine(tokenizer, test, step_time=0.01)


def test_a_request_past_its_deadline_fails_alone_with_request_timeout(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        late = await engine.add_request("late", [1], params(10**6), deadline=time.monotonic() + 0.2)
        good = await engine.add_request("good", [2], params(5), deadline=time.monotonic() + 3600)
        with pytest.raises(RequestTimeoutError, match="deadline"):
            await collect(late)
        assert (await collect(good))[-1].finished
        assert await until(lambda: engine.num_in_flight == 0 and engine.stats.num_running == 0)

    run_engine(tokenizer, test)


def test_a_request_the_core_cannot_take_fails_alone(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        good = await engine.add_request("good", [1], params(5))
        bad = await engine.add_request("bad", [7], params(5))
        with pytest.raises(RequestFailedError, match="a defect"):
            await collect(bad)
        assert (await collect(good))[-1].finished
        assert not engine.is_dead

    run_engine(tokenizer, test, refuse_token=7)


def test_queue_limit_counts_waiting_and_not_yet_taken_in(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
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

    run_engine(tokenizer, test, max_queue=2, max_running=1, step_time=0.02)


def test_queue_counts_only_what_finds_no_free_slot(tokenizer: Tokenizer) -> None:
    # An idle engine with 4 slots and --max-queue 4 takes a burst of 8 (4 run, 4 wait) and
    # refuses what comes beyond, however the core interleaves with the submissions: sequences
    # in transit and in the core both count, and so do free slots.
    async def test(engine: AsyncEngine) -> None:
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

    run_engine(tokenizer, test, max_queue=4, max_running=4, step_time=0.01)


def test_idle_core_does_not_step(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        await collect(await engine.add_request("a", [1], params(3)))
        assert await until(lambda: engine.stats.num_steps >= 3)
        steps = engine.stats.num_steps
        await asyncio.sleep(0.3)
        assert engine.stats.num_steps == steps

    run_engine(tokenizer, test)


def test_core_failure_fails_streams_and_new_requests(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        stream = await engine.add_request("a", [1], params(100))
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(stream)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], params())

    run_engine(tokenizer, test, fail_at_step=3)


def test_killed_core_fails_every_stream_at_once(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
        deaths: list[float] = []
        engine.on_death = lambda: deaths.append(time.monotonic())
        streams = [await engine.add_request(f"r{i}", [1], params(100_000)) for i in range(8)]
        assert await until(lambda: engine.stats.num_running == 4)
        os.kill(engine.core.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exited"):
                await collect(stream)
        assert deaths and deaths[0] >= killed and engine.is_dead and engine.num_in_flight == 0

    run_engine(tokenizer, test, step_time=0.01)


def test_drain_then_shutdown(tokenizer: Tokenizer) -> None:
    async def test(engine: AsyncEngine) -> None:
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
        assert await until(lambda: engine.stats.num_running == 0)

    run_engine(tokenizer, test, step_time=0.01)


def test_a_core_that_fails_to_load_says_why() -> None:
    core = CoreProcess(failing_factory)
    with pytest.raises(CoreStartError, match="model: no such file"):
        core.start(timeout=120)
    assert not core.process.is_alive()  # type: ignore[union-attr]
    core.close()


FRONT_END = textwrap.dedent("""
    import os, signal, sys, time
    from tests.server.fake_core import start_fake_core
    core, _ = start_fake_core()
    os.kill(core.pid, signal.SIGTERM)  # a process-group signal must not end the core ...
    os.kill(core.pid, signal.SIGINT)
    time.sleep(0.5)
    assert core.process.is_alive()
    print(core.pid, flush=True)
    time.sleep(600)  # ... but its front end's death must
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_core_outlives_a_killed_front_end() -> None:
    front = subprocess.Popen([sys.executable, "-c", FRONT_END], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = front.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"front end failed (status {front.wait()})"
        core_pid = int(line)
        assert is_alive(core_pid)
        front.kill()
        front.wait(30)
        deadline = time.monotonic() + 30
        while is_alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(core_pid)
        # SIGKILL left the front end no chance to remove its sockets' folder: the next one does
        stale = glob.glob(os.path.join(tempfile.gettempdir(), f"{FOLDER_PREFIX}{front.pid}-*"))
        assert len(stale) == 1 and os.listdir(stale[0]), stale
        CoreProcess(failing_factory).close()
        assert not os.path.exists(stale[0])
    finally:
        front.kill()
        front.wait(30)


def test_a_dead_front_ends_folder_goes_unless_something_listens_there(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Any) -> None:
    """A folder named after a pid that is gone but whose socket is bound (a /tmp shared with
    another pid namespace) is kept; once nothing listens there, it goes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait(30)
    folder = tmp_path / f"{FOLDER_PREFIX}{gone.pid}-x"
    folder.mkdir()
    context = zmq.Context()
    listener = context.socket(zmq.PULL)
    listener.bind(f"ipc://{folder}/outputs")
    try:
        remove_stale_folders()
        assert folder.exists()
    finally:
        listener.close(linger=0)
        context.term()
    remove_stale_folders()
    assert not folder.exists()


def test_messages_to_a_dead_core_are_dropped_not_blocked() -> None:
    # A PUSH socket whose peer is gone blocks a plain send for good: the event loop would hang
    # between the core's death and the moment its sentinel is handled.
    core, _ = start_fake_core()
    try:
        os.kill(core.pid, signal.SIGKILL)  # type: ignore[arg-type]
        core.process.join(30)  # type: ignore[union-attr]
        results: list[bool] = []
        sender = threading.Thread(target=lambda: results.extend(
            core.send(CoreInputs(abort=["x"])) for _ in range(50)), daemon=True)
        sender.start()
        sender.join(30)
        assert not sender.is_alive() and len(results) == 50
        asyncio.run(asyncio.wait_for(core.shutdown(), 30))
    finally:
        core.close()
