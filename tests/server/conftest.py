"""Fixtures for the HTTP tests.

`server` is one shared process (default model, float32, an API key) for every test that can
share it, since loading the model costs seconds; tests that must own a process (overload
limits, SIGTERM) start their own with `start_server`. Every process is killed at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.harness import API_KEY, ServerProcess, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    process = start_server("--api-key", API_KEY, "--max-num-seqs", "32", "--price-per-hour", "2.0")
    try:
        yield process
    finally:
        process.stop()
    # Bad input, hang-ups and bursts must all be handled: none may surface as a traceback.
    assert "Traceback" not in process.log(), process.log()[-4000:]
