"""Plots (from synthetic step stats), unit economics and the roofline arithmetic."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from dataclasses import replace

import pytest

from backfill.bench.economics import estimate_wasted_share, format_economics, unit_economics
from backfill.bench.metrics import RequestResult
from backfill.bench.plots import plot_latency_cdf, plot_rate_sweep, plot_slot_timeline, slot_matrix, slot_shares
from backfill.bench.roofline import (
    MachineRoofline,
    ModelShape,
    decode_roofline,
    format_machine,
    format_roofline_table,
    ideal_step,
    load_model_shape,
    measure_machine,
    median_machine,
    median_rounds,
    resolve_dtype,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


def _static_timeline(num_slots: int, lengths: list[int]) -> list[list[str]]:
    """Slot states of static batching: a batch runs until its longest request is done."""
    steps = []
    for first in range(0, len(lengths), num_slots):
        batch = lengths[first:first + num_slots]
        for k in range(max(batch)):
            states = ["useful" if k < n else "idle" for n in batch]
            steps.append(states + ["empty"] * (num_slots - len(batch)))
    return steps


def test_slot_matrix_and_shares() -> None:
    timeline = _static_timeline(2, [1, 3, 2])
    assert slot_matrix(timeline).tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 2, 2]]
    shares = slot_shares(timeline)
    assert shares == {"useful": 0.6, "idle": 0.2, "empty": 0.2}


def test_slot_timeline_png(tmp_path: Path) -> None:
    lengths = [2, 300, 5, 200, 3, 8, 400, 120] * 4
    static = _static_timeline(8, lengths)
    continuous = [["useful"] * 8 for _ in range(sum(lengths) // 8)] + [["useful"] * 3 + ["empty"] * 5] * 40
    out = plot_slot_timeline({"static": static, "continuous": continuous}, tmp_path / "t.png",
                             durations_s={"static": 12.0, "continuous": 6.0})
    width, height = _png_size(out)
    assert width > 800 and height > 300


def test_rate_sweep_and_cdf_png(tmp_path: Path) -> None:
    results = [
        {"request_rate": 1.0, "output_throughput": 50.0, "p99_ttft_ms": 80.0},
        {"request_rate": 4.0, "output_throughput": 180.0, "p99_ttft_ms": 300.0},
        {"request_rate": "inf", "output_throughput": 200.0, "p99_ttft_ms": 9000.0},
    ]
    assert _png_size(plot_rate_sweep({"backfill": results}, tmp_path / "r.png"))[0] > 500
    cdf = {"a": {"ttft": [0.1, 0.2, 0.3], "e2el": [1.0, 2.0]}, "b": {"ttft": [], "e2el": [3.0]}}
    assert _png_size(plot_latency_cdf(cdf, tmp_path / "c.png"))[0] > 500


def test_unit_economics() -> None:
    econ = unit_economics(price_per_hour=3.6, duration_s=100.0, output_tokens=50_000, wasted_share=0.25)
    assert econ["run_cost"] == pytest.approx(0.1)
    assert econ["cost_per_million_output_tokens"] == pytest.approx(2.0)
    assert econ["idle_slot_cost"] == pytest.approx(0.025)
    assert econ["idle_slot_cost_per_million_output_tokens"] == pytest.approx(0.5)
    assert "Cost per million output tokens" in format_economics(econ)
    unknown = unit_economics(1.0, 10.0, 10)
    assert unknown["idle_slot_cost"] is None and "wasted" not in format_economics(unknown)
    with pytest.raises(ValueError, match="wasted_share"):
        unit_economics(1.0, 1.0, 1, wasted_share=1.5)


def test_estimate_wasted_share() -> None:
    # 2 slots over 10 s; request A holds one from 0 to 10, B from 0 to 5, C (queued) from 0 to 10
    results = [RequestResult(success=True, start_time=0.0, latency=10.0),
               RequestResult(success=True, start_time=0.0, latency=5.0),
               RequestResult(success=True, start_time=0.0, latency=10.0)]
    assert estimate_wasted_share(results, num_slots=2, duration_s=10.0) == pytest.approx(0.0)
    assert estimate_wasted_share(results[:2], num_slots=2, duration_s=10.0) == pytest.approx(0.25)
    assert estimate_wasted_share(results[:1], num_slots=4, duration_s=10.0) == pytest.approx(0.75)


SMOL = ModelShape("smol", 134_515_008, 30, 576, 9, 3, 64, 49152, True)
MACHINE = MachineRoofline("cpu", 2, read_gbps=31.0, copy_gbps=26.0, matmul_gflops={"float32": 186.0, "bfloat16": 390.0})


def test_ideal_decode_step_matches_hand_arithmetic() -> None:
    # batch 1, no context: memory-bound, all weights once in bf16
    one = ideal_step(SMOL, MACHINE, "bfloat16", 1, 1, 0)
    assert one["bound"] == "memory"
    assert one["ideal_s"] == pytest.approx(134_515_008 * 2 / 31e9)
    # batch 64: compute-bound, 2 * params FLOPs per token
    big = ideal_step(SMOL, MACHINE, "bfloat16", 64, 64, 0)
    assert big["bound"] == "compute"
    assert big["ideal_s"] == pytest.approx(2 * 134_515_008 * 64 / 390e9)
    # KV read adds bytes: 64 seqs x 512 tokens x (2 x 30 x 3 x 64 x 2 bytes)
    with_kv = ideal_step(SMOL, MACHINE, "bfloat16", 1, 1, 512)
    assert with_kv["bytes"] - one["bytes"] == 512 * 23040
    auto = resolve_dtype("auto")  # what the engine computes in on this machine
    assert ideal_step(SMOL, MACHINE, "auto", 1, 1, 0) == ideal_step(SMOL, MACHINE, auto, 1, 1, 0)


def test_auto_dtype_means_what_the_engines_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with native bf16, the engine's "auto" runs the CPU kernels in float32, and the
    dense model (quantization "none", as transformers runs) in bfloat16."""
    import torch

    from backfill import kernels

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_dtype("auto", "cpu", quantization="none") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == ("float32" if kernels.available() else "bfloat16")
    assert resolve_dtype("float16", "cpu") == "float16"


def test_weights_as_stored_are_charged_their_own_bytes() -> None:
    """The CPU kernels read a GGUF's blocks: the memory bound is their bytes, whatever the
    compute dtype; the compute bound is unchanged."""
    stored = replace(SMOL, weight_bytes_per_step=96_000_000)
    one = ideal_step(stored, MACHINE, "float32", 1, 1, 0)
    assert one["bytes"] == 96_000_000 and one["ideal_s"] == pytest.approx(96e6 / 31e9)
    assert ideal_step(stored, MACHINE, "float32", 64, 64, 0) == ideal_step(SMOL, MACHINE, "float32", 64, 64, 0) | {
        "bytes": 96_000_000, "memory_s": pytest.approx(96e6 / 31e9)}


def test_compute_ceiling_is_the_fma_peak_where_it_is_higher() -> None:
    """fp32's ceiling is the better of the matmul and the FMA peak (a matmul slower than the
    packed kernels is no ceiling); other dtypes keep their matmul; no peak: the matmul."""
    peaked = replace(MACHINE, fma_peak_gflops=480.0)
    assert peaked.peak_gflops("float32") == 480.0 and peaked.peak_gflops("bfloat16") == 390.0
    assert replace(MACHINE, fma_peak_gflops=100.0).peak_gflops("float32") == 186.0
    assert MACHINE.peak_gflops("float32") == 186.0
    big = ideal_step(SMOL, peaked, "float32", 64, 64, 0)
    assert big["compute_s"] == pytest.approx(2 * 134_515_008 * 64 / 480e9)
    assert MachineRoofline.from_json(peaked.to_json()) == peaked
    old = peaked.to_json()
    del old["fma_peak_gflops"]  # a result file from before the peak was measured
    assert MachineRoofline.from_json(old) == MACHINE
    assert "fp32 FMA peak 480 GFLOP/s" in format_machine(peaked) and "FMA" not in format_machine(MACHINE)
    assert "(avx2 kernels)" in format_machine(replace(peaked, kernels_isa="avx2"))


def test_measured_machine_has_an_fma_peak_on_every_isa() -> None:
    """The CPU kernels time their FMA loop on each ISA they can run (any positive rate: the
    figure is the machine's, not asserted); bad arguments are refused."""
    from backfill import kernels

    ext = kernels.extension()
    if ext is None:
        pytest.skip("CPU kernels extension unavailable")
    machine = measure_machine("cpu", buffer_mb=8, matmul_n=64, repeats=2)
    assert machine.fma_peak_gflops is not None and machine.fma_peak_gflops > 0
    assert machine.kernels_isa == ext.isa()  # the kernels the peak (and the steps) ran on
    before = ext.isa()
    try:
        for isa in ("avx512", "avx2", "scalar"):
            if ext.set_isa(isa):
                assert 0 < ext.fma_peak_gflops(rounds=1000, repeats=1) < float("inf")
    finally:
        ext.set_isa(before)
    with pytest.raises(RuntimeError):
        ext.fma_peak_gflops(rounds=0)


def test_decode_roofline_rows_and_table() -> None:
    rows = decode_roofline(SMOL, MACHINE, "float32", [1, 8, 32, 64], 128, measured_s={1: 0.05, 32: 0.2})
    assert [r["batch_size"] for r in rows] == [1, 8, 32, 64]
    assert rows[0]["bound"] == "memory" and rows[-1]["bound"] == "compute"
    assert rows[0]["measured_over_ideal"] == pytest.approx(0.05 / (rows[0]["ideal_ms"] / 1000))
    assert "measured_ms" not in rows[1]
    table = format_roofline_table(rows)
    assert table.count("\n") == 5 and "| 8 | 128 |" in table and " - | - | - |" in table


def test_rounds_take_the_median_of_each_rounds_own_ratio() -> None:
    # three rounds: the machine and the steps move together (a neighbour's load), then apart
    fast = replace(MACHINE, read_gbps=40.0, fma_peak_gflops=400.0)
    slow = replace(MACHINE, read_gbps=20.0, fma_peak_gflops=200.0)
    odd = replace(MACHINE, read_gbps=31.0, fma_peak_gflops=500.0)
    rounds = [decode_roofline(SMOL, m, "float32", [1, 32], 128, measured_s=s)
              for m, s in ((fast, {1: 0.004, 32: 0.03}), (slow, {1: 0.008, 32: 0.06}), (odd, {1: 0.02, 32: 0.2}))]
    rows = median_rounds(rounds)
    assert [r["batch_size"] for r in rows] == [1, 32]
    for i, row in enumerate(rows):
        ratios = [r[i]["measured_over_ideal"] for r in rounds]
        assert row["ratios"] == ratios and row["measured_over_ideal"] == sorted(ratios)[1]
        assert row["measured_ms"] == sorted(r[i]["measured_ms"] for r in rounds)[1]
    # the fast and slow rounds agree (the same step on the same machine, at half speed)
    assert rows[0]["ratios"][0] == pytest.approx(rows[0]["ratios"][1])
    assert rows[0]["measured_over_ideal"] == pytest.approx(rows[0]["ratios"][0])
    table = format_roofline_table(rows)
    assert "each round" in table and "- batch 32: " + ", ".join(f"{x:.2f}x" for x in rows[1]["ratios"]) in table
    # one round: the table as before, no per-round list
    assert "each round" not in format_roofline_table(median_rounds(rounds[:1]))
    machine = median_machine([fast, slow, odd])
    assert (machine.read_gbps, machine.fma_peak_gflops) == (31.0, 400.0)
    assert machine.matmul_gflops == MACHINE.matmul_gflops and machine.device == "cpu"
    assert median_machine([MACHINE]).fma_peak_gflops is None


def test_model_shape_from_the_default_gguf_and_an_hf_folder(tmp_path: Path) -> None:
    shape = load_model_shape(None)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (30, 576, 9, 3)
    assert shape.head_dim == 64 and shape.vocab_size == 49152 and shape.tie_word_embeddings
    assert 134e6 < shape.num_params < 135e6
    # as stored: 30 layers of Q4_1 linears (5 bits a weight) + norms, and the Q8_0 tied head
    layers, head = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) * 20 // 32, 49152 * 576 * 34 // 32
    assert shape.weight_bytes_per_step == layers + head + 30 * 2 * 576 * 4
    # an HF folder: config.json and a safetensors header are enough
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 100,
        "intermediate_size": 64, "num_key_value_heads": 2, "tie_word_embeddings": False}))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [100, 32], "data_offsets": [0, 12800]},
                         "model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [12800, 12928]},
                         "lm_head.weight": {"dtype": "F32", "shape": [100, 32], "data_offsets": [12928, 25728]}})
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 25728)
    hf = load_model_shape(str(tmp_path))
    assert hf.num_params == 2 * 100 * 32 + 32 and hf.head_dim == 8 and not hf.tie_word_embeddings
    assert hf.matmul_params == 100 * 32 + 32  # an untied embedding is a lookup


def test_admissions_are_marked_when_request_ids_are_given() -> None:
    states = [["useful", "useful"], ["useful", "useful"], ["useful", "empty"]]
    ids = [["a", "b"], ["a", "c"], ["d", None]]
    assert slot_matrix(states, ids).tolist() == [[3, 0, 3], [3, 3, 2]]
    assert slot_shares(states)["useful"] == pytest.approx(5 / 6)
