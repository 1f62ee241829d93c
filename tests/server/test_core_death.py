"""The engine core process dying under load (issue 10, acceptance 2).

`kill -9` of the core while 8 streams are in flight: every client gets an OpenAI error object
within 5 s, `/health` answers 503, the server exits with status 1 (for its supervisor to
restart it) and leaves no process behind. And the other way round: `kill -9` of the server
ends its core.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.server.harness import MODEL, is_alive, start_server, wait_until

NUM_STREAMS = 8
ERROR_WITHIN_S = 5.0


def test_killed_core_fails_every_stream_and_the_server_exits() -> None:
    server = start_server("--max-num-seqs", "8")
    try:
        [core] = server.core_pids()
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        ended: list[float | None] = [None] * NUM_STREAMS
        last_events: list[str] = [""] * NUM_STREAMS

        def stream(index: int) -> None:
            body = {"model": MODEL, "prompt": f"Tale {index}: long ago,", "max_tokens": 4000,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        started[index].set()
                        if line != "data: [DONE]":
                            last_events[index] = line[len("data: "):]
            ended[index] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started)

        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(ERROR_WITHIN_S + 5)
        for index in range(NUM_STREAMS):
            assert ended[index] is not None and ended[index] - killed < ERROR_WITHIN_S  # type: ignore[operator]
            error = json.loads(last_events[index])["error"]
            assert error["type"] == "server_error" and error["code"] == "engine_dead"
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        late = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert late.status_code == 500 and late.json()["error"]["code"] == "engine_dead"

        assert server.process.wait(timeout=60) == 1
        assert not is_alive(core) and not server.core_pids()
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_killed_server_leaves_no_core_behind() -> None:
    server = start_server()
    try:
        [core] = server.core_pids()
        server.process.kill()
        server.process.wait(timeout=30)
        assert wait_until(lambda: not is_alive(core), 30)
    finally:
        server.stop()
