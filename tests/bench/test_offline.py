"""The offline benchmark and `bench compare` on the real default model, with tiny workloads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.bench.offline import (
    format_step_roofline,
    make_engine,
    measure_decode_step,
    run_offline_workload,
    step_summary,
    summarize_offline,
    warm_up,
)
from backfill.bench.roofline import MachineRoofline, load_model_shape
from backfill.bench.workloads import WorkloadRequest, WorkloadSpec, generate_workload
from backfill.config import POLICIES, EngineConfig

SLOTS = 4
WORKLOAD = generate_workload(
    WorkloadSpec(num_requests=8, short_tokens=(2, 3), long_tokens=(12, 20), prompt_words=(8, 16), seed=5)
)


@pytest.fixture(scope="module")
def engines() -> dict[str, object]:
    built = {policy: make_engine(EngineConfig(policy=policy, max_num_seqs=SLOTS, dtype="float32", max_model_len=256))
             for policy in POLICIES}
    for engine in built.values():
        warm_up(engine)  # type: ignore[arg-type]
    return built


def test_both_policies_serve_every_token_and_continuous_wastes_less(engines: dict[str, object]) -> None:
    runs = {p: run_offline_workload(e, WORKLOAD, p) for p, e in engines.items()}  # type: ignore[arg-type]
    for policy, run in runs.items():
        assert [r.output_len for r in run.results] == [r.max_tokens for r in WORKLOAD], policy
        assert all(r.success and r.prompt_len > 0 for r in run.results)
        assert all(len(s.slot_states) == SLOTS for s in run.step_stats)
        for r in run.results:
            assert 0 < r.ttft <= r.latency
            assert len(r.itl) <= r.output_len - 1
    cont, static = (step_summary(runs[p].step_stats) for p in ("continuous", "static"))
    assert cont["idle_slot_share"] == 0.0  # continuous never holds a finished request's slot
    assert static["idle_slot_share"] > 0.0
    assert cont["useful_slot_share"] > static["useful_slot_share"]
    assert cont["num_steps"] < static["num_steps"]
    # A machine faster than any real one (100 TB/s, 1 PFLOP/s): every measured step is slower
    # than its ideal whatever this machine is and however loaded.
    machine = MachineRoofline("cpu", 2, 1e5, 1e5, {"float32": 1e6, "bfloat16": 1e6})
    summary = summarize_offline(runs["continuous"], roofline=(load_model_shape(None), machine, "float32", 16),
                                price_per_hour=1.0)
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in WORKLOAD)
    assert 0 < summary["roofline_efficiency"] < 1.0  # nothing beats the roofline
    table = format_step_roofline(summary["decode_steps_by_batch"], min_steps=1)
    assert table.count("\n") == 1 + len(summary["decode_steps_by_batch"])
    assert all(r["measured_over_ideal"] > 1 for r in summary["decode_steps_by_batch"])
    assert summary["decode_steps_by_batch"] and summary["economics"]["wasted_slot_share"] == pytest.approx(
        1 - summary["useful_slot_share"])


def test_arrival_times_are_honoured(engines: dict[str, object]) -> None:
    requests = [WorkloadRequest(max_tokens=2, prompt="Hello there, friend.", arrival_time=0.0),
                WorkloadRequest(max_tokens=2, prompt="A second request.", arrival_time=0.4)]
    run = run_offline_workload(engines["continuous"], requests, "arrivals")  # type: ignore[arg-type]
    first, second = run.results
    assert second.start_time - first.start_time == pytest.approx(0.4)
    assert run.duration >= 0.4
    # it entered the engine only once it had arrived
    first_step = next(s for s in run.step_stats if any(i and i.endswith("-1") for i in s.slot_request_ids))
    assert first_step.start_time >= second.start_time
    assert second.ttft > 0


def test_rejected_request_is_a_failed_result(engines: dict[str, object]) -> None:
    requests = [WorkloadRequest(max_tokens=1000, prompt="too long for max_model_len 256"),
                WorkloadRequest(max_tokens=2, prompt="fine")]
    run = run_offline_workload(engines["continuous"], requests, "reject")  # type: ignore[arg-type]
    assert not run.results[0].success and "max_tokens" in run.results[0].error
    assert run.results[1].success


def test_measure_decode_step(engines: dict[str, object]) -> None:
    seconds = measure_decode_step(engines["continuous"], batch_size=2, prompt_len=16, num_steps=3)  # type: ignore[arg-type]
    assert 0 < seconds < float("inf")  # how long depends on the machine and its load


def test_cli_compare_all_three_systems(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [sys.executable, "-m", "backfill.bench.cli", "compare", "--num-requests", "4", "--short-tokens", "2", "3",
         "--long-tokens", "6", "10", "--prompt-words", "8", "12", "--batch-size", "2", "--repeats", "2",
         "--dtype", "float32", "--max-model-len", "128", "--no-roofline", "--no-progress", "--plot",
         "--price-per-hour", "1.5", "--result-file", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["medians"]) == {"continuous", "static", "hf"}
    assert all(len(runs) == 2 for runs in report["runs"].values())  # two rounds, each system once a round
    tokens = {name: m["total_output_tokens"] for name, m in report["medians"].items()}
    assert len(set(tokens.values())) == 1, tokens  # every system produced exactly the asked tokens
    assert report["ratios"]["continuous_vs_static_output_throughput"] > 0
    assert report["ratios"]["continuous_vs_hf_output_throughput"] > 0
    assert "| backfill continuous |" in proc.stdout and "transformers generate()" in proc.stdout
    for suffix in ("_slot_timeline.png", "_latency_cdf.png"):
        assert (tmp_path / f"compare{suffix}").read_bytes()[:4] == b"\x89PNG"


def test_roofline_counts_every_kv_cache_dtype() -> None:
    """`bench roofline --kv-cache-dtype X` counts the KV bytes the engine's cache holds, for every
    type the engine takes (a new one without its size here failed the command)."""
    import dataclasses

    import torch

    from backfill.config import KV_CACHE_TORCH_DTYPES
    from backfill.model.loader import kv_cache_torch_dtype

    shape = load_model_shape(None)
    per_element = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    for name in KV_CACHE_TORCH_DTYPES:
        dtype = kv_cache_torch_dtype(name, torch.float32)
        kv_shape = dataclasses.replace(shape, kv_dtype=str(dtype).removeprefix("torch."))
        assert kv_shape.kv_bytes_per_token("float32") == per_element * dtype.itemsize, name
