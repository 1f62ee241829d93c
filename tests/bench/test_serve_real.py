"""`bench serve` against a real `backfill` server subprocess; token counts checked against /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from backfill.bench.serve_client import ServeBenchConfig, parse_generation_tokens_total, run_serve_benchmark
from backfill.bench.workloads import WorkloadSpec, generate_workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "backfill.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-num-seqs", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.fail(f"the server exited with {proc.returncode}:\n{output[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not become healthy within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_counts_match_server_metrics(server_url: str) -> None:
    requests = generate_workload(WorkloadSpec(num_requests=8, short_tokens=(2, 4), long_tokens=(16, 24),
                                              prompt_words=(8, 16), seed=11))
    before = httpx.get(server_url + "/metrics", timeout=10).text
    assert "backfill:generation_tokens_total" in before
    result = run_serve_benchmark(requests, ServeBenchConfig(base_url=server_url, request_rate=20.0, show_progress=False,
                                                             goodput_slo_ms={"ttft": 60_000.0}))
    after = httpx.get(server_url + "/metrics", timeout=10).text
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    expected = sum(r.max_tokens for r in requests)
    assert result["total_output_tokens"] == expected  # ignore_eos: exactly the asked lengths
    assert result["num_output_len_mismatch"] == 0
    # the server's own counter moved by what we counted (the warm-up request came before `before`)
    server_delta = parse_generation_tokens_total(after) - parse_generation_tokens_total(before)  # type: ignore[operator]
    assert server_delta == expected
    assert result["server_generation_tokens_delta"] == expected
    assert result["total_input_tokens"] > 0 and result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] > 0
    assert result["request_goodput"] is not None and result["max_concurrent_requests"] >= 1
