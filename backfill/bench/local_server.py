"""A real `backfill serve` on loopback, for benchmarks and tests that measure one end to end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_server(flags: Sequence[str], log_path: str | Path | None = None, port: int = 0,
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 60.0) -> Iterator[str]:
    """`backfill serve --port P FLAGS...` until the block ends; yields its base URL once /health
    answers. Its output goes to `log_path` (default: a temporary file). Raises RuntimeError,
    with the output's tail, if it exits or is not healthy within `start_timeout_s`."""
    port = port or free_port()
    log = open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "backfill.entrypoints.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"

    def output_tail() -> str:
        log.flush()
        log.seek(0)
        return log.read().decode(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{output_tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy within {start_timeout_s:.0f} s:\n{output_tail()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
