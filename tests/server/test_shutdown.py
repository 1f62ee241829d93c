"""Acceptance 6: SIGTERM during 8 streams: they all finish, new requests get 503, exit status 0.

A ninth stream that cannot finish within the grace period is cut off at its end with an error
event (and `[DONE]`), so the process still exits on time: within --shutdown-timeout plus a
fraction of a second (the server guarantees EXIT_GRACE_S = 1 s from handling the signal;
EXIT_BOUND_S leaves room for delivering it and reaping the process on a loaded machine).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx

from tests.server.harness import MODEL, is_alive, start_server, wait_until

NUM_STREAMS = 8
MAX_TOKENS = 32
GRACE_S = 15
EXIT_BOUND_S = 1.5


def test_sigterm_drains_in_flight_streams() -> None:
    server = start_server("--shutdown-timeout", str(GRACE_S))
    try:
        limits = [MAX_TOKENS] * NUM_STREAMS + [8000]  # the last one outlives the grace period
        started = [threading.Event() for _ in limits]
        events: list[list[str]] = [[] for _ in limits]
        errors: list[BaseException] = []

        def stream(index: int) -> None:
            body = {"model": MODEL, "prompt": f"Tale {index}: long ago,", "max_tokens": limits[index],
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            try:
                with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=120) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            events[index].append(line[len("data: "):])
                            started[index].set()
            except BaseException as error:  # reported by the main thread
                errors.append(error)
                started[index].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(limits))]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started) and not errors, errors

        cores = server.core_pids()
        assert len(cores) == 1
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": "late"}, timeout=30)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 503
        # Refused while a request is still in flight: the ninth lasts the whole grace period (the
        # eight short ones may all be done by now on a fast machine).
        assert events[-1][-1] != "[DONE]", "the long stream ended before the 503 check"

        for thread in threads:
            thread.join(120)
        assert not errors, errors
        for stream_events in events[:NUM_STREAMS]:
            assert stream_events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in stream_events[:-1]]
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        cut = events[-1]
        assert cut[-1] == "[DONE]" and json.loads(cut[-2])["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=60) == 0
        assert GRACE_S - 1 < time.monotonic() - signalled < GRACE_S + EXIT_BOUND_S
        assert wait_until(lambda: not is_alive(cores[0]), 30)  # no core outlives the server
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_sigterm_exits_on_time_whatever_is_stuck() -> None:
    grace = 2.0
    server = start_server("--shutdown-timeout", str(grace))
    try:
        endless = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True}
        url = urlparse(server.base_url)
        stuck = socket.create_connection((url.hostname, url.port))  # headers that never end
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        results: dict[str, object] = {}
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", server.v1 + "/completions", json={**endless, "stream": True},
                              timeout=60) as response:
                events = []
                for line in response.iter_lines():
                    streaming.set()
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
            results["stream"] = events

        def whole() -> None:
            results["whole"] = httpx.post(server.v1 + "/completions", json=endless, timeout=60).status_code

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for thread in threads:
            thread.start()
        assert streaming.wait(60)
        cores = server.core_pids()
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.process.wait(timeout=60) == 0
        assert grace - 0.5 < time.monotonic() - signalled < grace + EXIT_BOUND_S
        for thread in threads:
            thread.join(30)
        events = results["stream"]
        assert isinstance(events, list) and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert results["whole"] == 503
        assert cores and wait_until(lambda: not is_alive(cores[0]), 30)
        stuck.close()
        assert "Traceback" not in server.log()
    finally:
        server.stop()
