"""`backfill bench workload` and `backfill bench roofline` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.bench.workloads import load_workload


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "backfill.bench.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_workload_command(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    proc = _bench("workload", "-o", str(out), "--num-requests", "10", "--short-share", "0.3",
                  "--arrival", "gamma", "--arrival-rate", "5", "--arrival-burstiness", "0.5", "--seed", "4")
    assert proc.returncode == 0, proc.stderr
    requests = load_workload(out)
    assert len(requests) == 10 and sum(r.max_tokens <= 8 for r in requests) == 3
    assert requests[0].arrival_time == 0.0 and requests[-1].arrival_s > 0
    assert json.loads(proc.stdout)["num_requests"] == 10
    again = tmp_path / "again.jsonl"
    assert _bench("workload", "-o", str(again), "--num-requests", "10", "--short-share", "0.3", "--arrival", "gamma",
                  "--arrival-rate", "5", "--arrival-burstiness", "0.5", "--seed", "4").returncode == 0
    assert again.read_text() == out.read_text()


def test_bad_input_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    proc = _bench("serve", "--base-url", "http://127.0.0.1:9", "--workload", str(bad))
    assert proc.returncode == 2 and "max_tokens" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [["serve", "--base-url", "http://127.0.0.1:9"], ["compare"]])
def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, command: list[str]) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "x", "max_tokens": 2}\n')
    hide = "import sys; sys.modules['matplotlib'] = None; from backfill.bench.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide, *command, "--workload", str(workload), "--plot"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"backfill bench {command[0]}: " in proc.stderr and "pip install 'backfill[bench]'" in proc.stderr


def test_roofline_command_with_measured_steps(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    proc = _bench("roofline", "--batch-sizes", "1", "2", "--context-len", "16", "--measure-steps", "2",
                  "--dtype", "float32", "--buffer-mb", "128", "--repeats", "2", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["batch_size"] for r in data["rows"]] == [1, 2]
    assert len(data["rounds"]) == 2 and all(len(r["ratios"]) == 2 for r in data["rows"])
    assert "round 2/2: device cpu" in proc.stdout and "median over 2 round(s)" in proc.stdout
    assert all(r["measured_ms"] > 0 and r["ideal_ms"] > 0 for r in data["rows"])
    assert data["machine"]["read_gbps"] > 0 and data["machine"]["matmul_gflops"]["float32"] > 0
    assert "| batch | context | ideal step (ms) |" in proc.stdout and data["host"]["num_cpus"] >= 1


def test_structured_command_runs_equal_work_with_and_without_grammars(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    proc = _bench("structured", "--batch-size", "4", "--max-tokens", "12", "--repeats", "1", "--dtype", "float32",
                  "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    # every request makes exactly max_tokens tokens in both runs: the grammar never ends one early
    assert data["output_tokens_per_run"] == [4 * 12, 4 * 12]
    assert data["mask_us_per_row"] > 0 and len(data["ratios"]) == 1 and "median ratio" in proc.stdout


def test_divergence_command_measures_int8_against_fp32(tmp_path: Path) -> None:
    out = tmp_path / "divergence.json"
    proc = _bench("divergence", "--num-prompts", "3", "--max-tokens", "6", "--prompt-words", "5", "20",
                  "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 3 and 0 <= data["same_outputs"] <= 3 and 0 <= data["mean_agreed_share"] <= 1
    # teacher-forced over every prompt token and output token: the error is measured, not zero
    assert data["positions"] > 3 * 5 and 0 < data["max_abs_logit_error"] < data["max_abs_logit"]
    assert 0 < data["mean_abs_logit_error"] <= data["max_abs_logit_error"] and 0 < data["argmax_agreement"] <= 1
    assert "greedy agreement:" in proc.stdout and "max |error|" in proc.stdout and "int8 x (" in proc.stdout


def test_divergence_command_measures_a_bf16_kv_cache(tmp_path: Path) -> None:
    out = tmp_path / "divergence.json"
    proc = _bench("divergence", "--variant", "bf16-kv-cache", "--num-prompts", "2", "--max-tokens", "6",
                  "--prompt-words", "5", "20", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["variant"] == "bf16-kv-cache" and data["num_prompts"] == 2
    assert 0 < data["max_abs_logit_error"] < data["max_abs_logit"] and 0 < data["argmax_agreement"] <= 1
    assert "a bf16 KV cache (" in proc.stdout and "int8 x (" not in proc.stdout


@pytest.mark.parametrize("args", [["--num-prompts", "0"], ["--prompt-words", "9", "3"]])
def test_divergence_command_refuses_bad_arguments(args: list[str]) -> None:
    proc = _bench("divergence", *args)
    assert proc.returncode == 2 and "backfill bench divergence: " in proc.stderr and "Traceback" not in proc.stderr
