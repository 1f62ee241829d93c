"""The scripts the GPU check runs (scripts/gpu_check.sh), run here on CPU over a tiny random
Hugging Face model, so that a device session never spends its minutes on a broken script:
random_hf_model.py writes the model, profile_step.py profiles decode and mixed steps,
serve_check.py serves it and benchmarks the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("llama-tiny")
    run_script("random_hf_model.py", str(out), "--shape", "llama-tiny", "--device", "cpu")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    return str(out)


@pytest.mark.parametrize("admit", [False, True])
def test_profile_step(tiny_hf_model: str, tmp_path: Path, admit: bool) -> None:
    result = tmp_path / "profile.json"
    # the plain-PyTorch model (as on a GPU): the CPU kernels' decode steps call no torch op
    run_script("profile_step.py", "--model", tiny_hf_model, "--quantization", "none", "--batch", "3",
               "--context", "12", "--steps", "3", "--result-file", str(result), *(["--admit"] if admit else []))
    summary = json.loads(result.read_text())
    assert summary["admit"] is admit and summary["steps"] == 3  # every profiled step of the planned kind
    assert len(summary["step_ms"]) == 3 and min(summary["step_ms"]) > 0
    names = {op["name"] for op in summary["host_ops"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names


def test_serve_check(tiny_hf_model: str, tmp_path: Path) -> None:
    result = tmp_path / "serve_check.json"
    run_script("serve_check.py", "--num-requests", "6", "--max-num-seqs", "4", "--result-file", str(result),
               "--", "--model", tiny_hf_model)
    summary = json.loads(result.read_text())
    assert summary["ok"], summary.get("error")
    assert summary["checks"]["completion"]["seconds"] > 0 and summary["checks"]["metrics_lines"] > 0
    assert summary["bench_serve"]  # bench serve's own JSON, read back
