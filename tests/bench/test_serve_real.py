"""`bench serve` against a real `backfill` server subprocess; token counts checked against /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from backfill.bench.local_server import local_server
from backfill.bench.serve_client import ServeBenchConfig, parse_generation_tokens_total, run_serve_benchmark
from backfill.bench.workloads import WorkloadSpec, generate_workload


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with local_server(["--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "1024"],
                      start_timeout_s=180, stop_timeout_s=30) as url:
        yield url


def test_bench_serve_counts_match_server_metrics(server_url: str) -> None:
    requests = generate_workload(WorkloadSpec(num_requests=8, short_tokens=(2, 4), long_tokens=(16, 24),
                                              prompt_words=(8, 16), seed=11))
    before = httpx.get(server_url + "/metrics", timeout=10).text
    assert "backfill:generation_tokens_total" in before
    config = ServeBenchConfig(base_url=server_url, request_rate=20.0, show_progress=False, num_warmups=0,
                              goodput_slo_ms={"ttft": 60_000.0})
    result = run_serve_benchmark(requests, config)
    after = httpx.get(server_url + "/metrics", timeout=10).text
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    expected = sum(r.max_tokens for r in requests)
    assert result["total_output_tokens"] == expected  # ignore_eos: exactly the asked lengths
    assert result["num_output_len_mismatch"] == 0
    # the server's own counter moved by exactly what we counted
    server_delta = parse_generation_tokens_total(after) - parse_generation_tokens_total(before)  # type: ignore[operator]
    assert server_delta == expected
    assert result["server_generation_tokens_delta"] == expected
    assert result["total_input_tokens"] > 0 and result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] > 0
    assert result["request_goodput"] is not None and result["max_concurrent_requests"] >= 1


def test_bench_serve_cli_sweep_excludes_the_warm_up_from_the_check(server_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from backfill.bench.workloads import save_workload

    workload = tmp_path / "w.jsonl"
    save_workload(generate_workload(WorkloadSpec(num_requests=4, short_tokens=(2, 3), long_tokens=(6, 8), seed=2)), workload)
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "backfill.bench.cli", "serve", "--base-url", server_url, "--workload", str(workload),
         "--request-rate", "50", "inf", "--result-file", str(out), "--plot", "--no-progress",
         "--price-per-hour", "1.0", "--num-slots", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rate in ("50", "inf"):
        data = json.loads((tmp_path / f"serve-rate{rate}.json").read_text())
        assert data["server_generation_tokens_delta"] == data["total_output_tokens"]  # warm-up not counted
        assert 0 <= data["economics"]["wasted_slot_share"] <= 1
    assert proc.stdout.count("matches the") == 2
    assert (tmp_path / "serve_rate_sweep.png").exists() and (tmp_path / "serve_latency_cdf.png").exists()


def test_bench_serve_with_the_dashboard_open_and_closed(server_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from backfill.bench.dashboard_browser import browser_available
    from backfill.bench.workloads import save_workload

    why = browser_available()
    if why is not None:
        if os.environ.get("CI"):  # the set-up (make test) installs it: missing there is a failure
            pytest.fail(why)
        pytest.skip(why)
    workload = tmp_path / "w.jsonl"
    save_workload(generate_workload(WorkloadSpec(num_requests=4, short_tokens=(2, 3), long_tokens=(6, 8), seed=3)), workload)
    proc = subprocess.run(
        [sys.executable, "-m", "backfill.bench.cli", "serve", "--base-url", server_url, "--workload", str(workload),
         "--request-rate", "inf", "--result-file", str(tmp_path / "serve.json"), "--no-progress", "--num-warmups", "0",
         "--dashboard", "both"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    closed = json.loads((tmp_path / "serve.json").read_text())
    opened = json.loads((tmp_path / "serve-dashboard.json").read_text())
    assert "dashboard_polls" not in closed and opened["dashboard_status"].startswith("live")
    assert closed["total_output_tokens"] == opened["total_output_tokens"] > 0
    ratio = opened["output_throughput"] / closed["output_throughput"]
    assert f"ratio {ratio:.4f}" in proc.stdout


def test_plan_probe_measures_the_server(server_url: str) -> None:
    """`plan calibrate --base-url`: the server's front-end delay and step factor, measured
    against a step-time model (here a fixed one; `plan calibrate` fits it first)."""
    from backfill.bench.calibrate import PROBE_REPEATS, probe_server
    from backfill.bench.cost_model import Calibration
    from backfill.config import EngineConfig

    model = Calibration(intercept_s=0.005, per_token_s=0.001, per_seq_s=0.0005, per_kv_token_s=1e-6,
                        max_position_embeddings=8192, kv_bytes_per_token=46080)
    probed = probe_server(server_url, model, EngineConfig(max_model_len=1024))  # its slots: from /v1/stats
    assert probed.frontend_s >= 0 and probed.served_step_factor > 0
    assert (probed.intercept_s, probed.per_token_s) == (model.intercept_s, model.per_token_s)  # only the server terms
    probe = probed.description["probe"]
    assert probe["num_slots"] == 8 and len(probe["burst_ratios"]) == PROBE_REPEATS
    assert probed.served_step_factor == pytest.approx(sorted(probe["burst_ratios"])[PROBE_REPEATS // 2])
