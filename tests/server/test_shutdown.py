"""Acceptance 6: SIGTERM during 8 streams: they all finish, new requests get 503, exit status 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.server.harness import MODEL, start_server

NUM_STREAMS = 8
MAX_TOKENS = 96


def test_sigterm_drains_in_flight_streams() -> None:
    server = start_server("--shutdown-timeout", "120")
    try:
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        events: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        errors: list[BaseException] = []

        def stream(index: int) -> None:
            body = {"model": MODEL, "prompt": f"Tale {index}: long ago,", "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True}
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

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started) and not errors, errors

        server.process.send_signal(signal.SIGTERM)
        refused = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": "late"}, timeout=30)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 503
        assert any(not e or e[-1] != "[DONE]" for e in events), "streams ended before the 503 check"

        for thread in threads:
            thread.join(120)
        assert not errors, errors
        for stream_events in events:
            assert stream_events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in stream_events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=60) == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()
