"""The load client against a fake OpenAI-compatible streaming server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.bench.serve_client import ServeBenchConfig, parse_generation_tokens_total, run_serve_benchmark
from backfill.bench.workloads import WorkloadRequest, WorkloadSpec, generate_workload, save_workload
from tests.bench.fake_server import FakeServer, FakeServerState


def _workload(n: int = 12) -> list[WorkloadRequest]:
    return generate_workload(WorkloadSpec(num_requests=n, short_tokens=(2, 4), long_tokens=(10, 20), seed=3))


def test_all_at_once_counts_tokens_and_matches_server_counter() -> None:
    state = FakeServerState()
    requests = _workload()
    with FakeServer(state) as server:
        result = run_serve_benchmark(requests, ServeBenchConfig(base_url=server.base_url, show_progress=False))
    expected_total = sum(r.max_tokens for r in requests)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == expected_total
    assert result["server_generation_tokens_delta"] == expected_total  # warm-up excluded
    # Prefix cache: the hit rate from the responses' usage is the one the server counted.
    assert result["total_cached_input_tokens"] == sum(n // 2 for n in result["input_lens"])
    assert result["prefix_cache_hit_rate"] == pytest.approx(
        result["total_cached_input_tokens"] / result["total_input_tokens"])
    assert result["server_prefix_cache_hit_rate"] == pytest.approx(result["prefix_cache_hit_rate"])
    assert result["num_output_len_mismatch"] == 0
    assert result["output_lens"] == [r.max_tokens for r in requests]  # in workload order
    assert result["model_id"] == "fake-model"
    # All twelve are sent before any can end (the client starts each one's clock before its
    # first await). How many the server sees at once is the OS scheduler's business: a loaded
    # machine may finish one before it accepts the last (11 of 12 failed `make test` once).
    assert result["max_concurrent_requests"] == 12 and 1 <= state.max_in_flight <= 12
    # every measured payload streams, asks for usage and ignores EOS
    measured = state.payloads[1:]
    assert all(p["stream"] and p["ignore_eos"] and p["stream_options"]["include_usage"] for p in measured)
    assert sorted(p["max_tokens"] for p in measured) == sorted(r.max_tokens for r in requests)
    # token events: one TTFT plus (n - 1) ITLs per request; latencies are positive and ordered
    assert [len(i) + 1 for i in result["itls"]] == [r.max_tokens for r in requests]
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    # The fake server sleeps 2 ms before each token, so no request can end sooner than that
    # (how the gaps between tokens look depends on when the client gets to read them).
    for e2el, request in zip(result["e2els"], requests):
        assert e2el >= 0.99 * request.max_tokens * state.token_delay_s
    assert result["total_input_tokens"] > 0  # from usage.prompt_tokens


def test_request_rate_spreads_arrivals_and_fallback_counts_chunks() -> None:
    state = FakeServerState(send_usage=False, token_delay_s=0.001)
    requests = [WorkloadRequest(max_tokens=3, prompt_token_ids=[1, 2, 3, 4]) for _ in range(8)]
    config = ServeBenchConfig(base_url="", request_rate=40.0, seed=1, show_progress=False, num_warmups=0)
    with FakeServer(state) as server:
        result = run_serve_benchmark(requests, ServeBenchConfig(**{**config.__dict__, "base_url": server.base_url}))
    assert result["request_rate"] == 40.0
    assert result["total_output_tokens"] == 24  # counted chunks, no usage sent
    assert result["total_input_tokens"] == 32  # len(prompt_token_ids)
    # The client sleeps until each seeded arrival: the run lasts at least until the last one.
    assert result["duration"] >= max(result["start_times"]) > 0.05
    assert state.payloads[0]["prompt"] == [1, 2, 3, 4]


def test_failures_and_short_streams_are_reported() -> None:
    state = FakeServerState(fail_every=3, short_by=1)
    requests = [WorkloadRequest(max_tokens=5, prompt="hello there") for _ in range(6)]
    with FakeServer(state) as server:
        result = run_serve_benchmark(
            requests,
            ServeBenchConfig(base_url=server.base_url, show_progress=False, num_warmups=0, goodput_slo_ms={"ttft": 1e6}),
        )
    assert result["failed"] == 2 and result["completed"] == 4
    assert sum("HTTP 500" in e for e in result["errors"]) == 2
    assert result["num_output_len_mismatch"] == 4  # each received 4 of 5
    assert result["total_output_tokens"] == 16
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])


def test_parse_generation_tokens_total() -> None:
    text = (
        "# TYPE backfill:generation_tokens_total counter\n"
        'backfill:generation_tokens_total{model_name="m"} 12.0\n'
        "backfill:generation_tokens_created 1.7e9\n"
        'vllm:generation_tokens_total{model_name="m",engine="0"} 3\n'
        "other_total 5\n"
    )
    assert parse_generation_tokens_total(text) == 15.0
    assert parse_generation_tokens_total("x 1\n") is None


def test_cli_serve_writes_vllm_json(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    save_workload(_workload(4), workload)
    out = tmp_path / "r.json"
    state = FakeServerState()
    with FakeServer(state) as server:
        proc = subprocess.run(
            [sys.executable, "-m", "backfill.bench.cli", "serve", "--base-url", server.base_url,
             "--workload", str(workload), "--result-file", str(out), "--request-rate", "inf",
             "--goodput", "ttft:5000", "tpot:100", "--price-per-hour", "2.0", "--no-progress"],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for key in ("duration", "completed", "failed", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_e2el_ms",
                "max_concurrent_requests", "request_goodput"):
        assert key in data, key
    assert data["request_rate"] == "inf" and data["completed"] == 4
    assert data["economics"]["cost_per_million_output_tokens"] > 0
    assert math.isclose(data["economics"]["price_per_hour"], 2.0)
    assert "Serving Benchmark Result" in proc.stdout
