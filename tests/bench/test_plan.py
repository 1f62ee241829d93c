"""`backfill plan`: the simulation over the real Scheduler, the cost model's fit, the SLO choice,
calibration files, and the CLI on a calibration measured on the real default model.

Simulated times come from the cost model, never from a clock: every figure is exact."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from backfill.bench.cost_model import (CALIBRATION_VERSION, PADDING_CONTEXT_COST, Calibration, StepShape,
                                       calibration_from_steps, choose_knots, fit_step_times, step_shape)
from backfill.bench.planner import PlanPoint, cheapest, format_plan, parse_slo, run_point, sim_requests, sweep_points
from backfill.bench.serve_client import ServeBenchConfig, schedule_arrivals
from backfill.bench.simulator import SimRequest, simulate
from backfill.bench.workloads import WorkloadRequest, WorkloadSpec, at_rate, generate_workload, save_workload
from backfill.config import EngineConfig
from backfill.core.outputs import ScheduledRequest, SchedulerOutput

STEP_S = 0.01


def constant(step_s: float = STEP_S, **overrides: float) -> Calibration:
    """Every step costs `step_s`, whatever it computes."""
    return Calibration(intercept_s=step_s, per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0,
                       max_position_embeddings=2048, kv_bytes_per_token=1024, **overrides)  # type: ignore[arg-type]


def prompt(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{"max_num_seqs": 4, "max_model_len": 256, "enable_prefix_caching": False, **overrides})  # type: ignore[arg-type]


# ------------------------------------------------------------------ exact simulations by hand


def test_constant_steps_give_hand_computed_figures() -> None:
    # Two 3-token requests at once, both admitted: step 1 prefills both and samples their first
    # token (t = 0.01), steps 2 and 3 decode (0.02, 0.03).
    run = simulate([SimRequest(prompt(4), 3, 0.0), SimRequest(prompt(5, 200), 3, 0.0)], config(),
                   constant(), served=False)
    summary = run.summary()
    assert run.num_steps == 3
    assert run.duration == pytest.approx(0.03)
    assert summary["output_throughput"] == pytest.approx(6 / 0.03)
    assert summary["median_ttft_ms"] == pytest.approx(10.0)
    assert summary["median_tpot_ms"] == pytest.approx(10.0)
    assert summary["slot_utilization"] == pytest.approx(2 / 4)  # 2 of 4 slots busy throughout


def test_one_slot_serves_in_turn() -> None:
    run = simulate([SimRequest(prompt(4), 3, 0.0), SimRequest(prompt(4, 300), 3, 0.0)], config(max_num_seqs=1),
                   constant(), served=False)
    summary = run.summary()
    assert run.duration == pytest.approx(0.06)
    assert sorted(summary["ttfts"]) == pytest.approx([0.01, 0.04])  # the second waits for the first
    assert summary["slot_utilization"] == pytest.approx(1.0)


def test_arrival_during_a_step_joins_the_next_and_front_end_delays_it() -> None:
    # Steps of 0.25 s, a front end of 0.125 s (binary fractions: exact ties). r0 reaches the core
    # at 0.125; its steps end at 0.375, 0.625, 0.875, 1.125. r1 reaches it at 0.625, just as step
    # 3 starts: it joins that step. r2 reaches it at 0.635, during step 3: it waits for step 4.
    calibration = constant(step_s=0.25, frontend_s=0.125)
    requests = [SimRequest(prompt(4), 4, 0.0), SimRequest(prompt(4, 300), 2, 0.5), SimRequest(prompt(4, 400), 1, 0.51)]
    run = simulate(requests, config(), calibration)
    assert run.summary()["ttfts"] == pytest.approx([0.375, 0.875 - 0.5, 1.125 - 0.51])
    assert run.duration == pytest.approx(1.125)


def test_served_step_factor_scales_every_step() -> None:
    requests = [SimRequest(prompt(4), 5, 0.0)]
    offline = simulate(requests, config(), constant(served_step_factor=2.0), served=False)
    served = simulate(requests, config(), constant(served_step_factor=2.0))
    assert served.duration == pytest.approx(2 * offline.duration)
    # In-process, each step also pays its output processing: per step and per token returned.
    in_process = simulate(requests, config(), constant(offline_step_s=0.001, offline_token_s=0.002), served=False)
    assert in_process.duration == pytest.approx(5 * (STEP_S + 0.001 + 0.002))


def test_warmup_request_leaves_its_prompt_cached_and_the_clock_at_zero() -> None:
    # bench serve's warm-up sends the first prompt (4 tokens at most) before the measured run:
    # its 2 full blocks (32 of 40 tokens) are then cached, so the run's first step computes 8.
    calibration = Calibration(intercept_s=0.01, per_token_s=0.001, per_seq_s=0.0, per_kv_token_s=0.0)
    request = SimRequest(prompt(40), 1, 0.0)
    cold = simulate([request], config(enable_prefix_caching=True), calibration)
    warm = simulate([request], config(enable_prefix_caching=True), calibration, warmup=[SimRequest(prompt(40), 4, 0.0)])
    assert cold.summary()["ttfts"] == pytest.approx([0.01 + 40 * 0.001])
    assert warm.summary()["ttfts"] == pytest.approx([0.01 + 8 * 0.001])
    assert warm.num_steps == 1 and warm.duration == pytest.approx(0.018)


def test_step_time_follows_the_shape() -> None:
    # One 20-token prompt, then decodes: the first step has 20 tokens over 20 KV entries.
    calibration = Calibration(intercept_s=0.001, per_token_s=0.0001, per_seq_s=0.0005, per_kv_token_s=0.00001)
    run = simulate([SimRequest(prompt(20), 2, 0.0)], config(), calibration, served=False)
    first = 0.001 + 20 * 0.0001 + 0.0005 + 20 * 0.00001
    second = 0.001 + 0.0001 + 0.0005 + 21 * 0.00001
    assert run.summary()["ttfts"] == pytest.approx([first])
    assert run.duration == pytest.approx(first + second)


def test_step_shape_counts_padding_rows() -> None:
    output = SchedulerOutput(scheduled=[ScheduledRequest("a", [1] * 8, 0, [0], sample=True),
                                        ScheduledRequest("b", [1], 30, [1, 2], sample=True)],
                             num_batched_tokens=9, padding_seq_lens=[12, 40])
    # the padding rows' contexts (12 and 40) read the cached scratch block: charged at PADDING_CONTEXT_COST
    assert step_shape(output) == StepShape(num_tokens=11, num_seqs=4,
                                           num_kv_tokens=8 + 31 + round(PADDING_CONTEXT_COST * 52), num_sampled=2)


def test_a_prompt_that_does_not_fit_fails_like_the_server() -> None:
    run = simulate([SimRequest(prompt(250), 10, 0.0), SimRequest(prompt(4), 2, 0.0)], config(), constant())
    summary = run.summary()
    assert summary["failed"] == 1 and summary["completed"] == 1
    assert "max_model_len" in summary["errors"][0]


# ------------------------------------------------------------------ policies and replicas


MIXED = generate_workload(WorkloadSpec(num_requests=24, kind="mixed", short_tokens=(2, 4), long_tokens=(40, 60),
                                       prompt_words=(8, 16), seed=3))


def mixed_requests() -> list[SimRequest]:
    # Token counts without a tokenizer: one id per word is enough for the scheduler.
    return [SimRequest(prompt(len((r.prompt or "").split()), 10 * i), r.max_tokens, r.arrival_s)
            for i, r in enumerate(MIXED)]


def test_continuous_beats_static_on_a_mixed_workload() -> None:
    calibration = Calibration(intercept_s=0.02, per_token_s=0.0005, per_seq_s=0.001, per_kv_token_s=1e-6)
    rows = {policy: simulate(mixed_requests(), config(max_num_seqs=8, policy=policy), calibration,
                             served=False).summary() for policy in ("continuous", "static")}
    total = sum(r.max_tokens for r in MIXED)
    assert rows["continuous"]["total_output_tokens"] == rows["static"]["total_output_tokens"] == total
    assert rows["continuous"]["output_throughput"] > 1.3 * rows["static"]["output_throughput"]
    assert rows["continuous"]["slot_utilization"] > rows["static"]["slot_utilization"]


def test_two_replicas_halve_the_time_and_double_the_price() -> None:
    requests = [SimRequest(prompt(4, 10 * i), 5, 0.0) for i in range(4)]
    one = run_point(requests, config(max_num_seqs=1), constant(), PlanPoint(1, "continuous", 1), 1.0, served=False)
    two = run_point(requests, config(max_num_seqs=1), constant(), PlanPoint(1, "continuous", 2), 1.0, served=False)
    assert one["duration"] == pytest.approx(0.2) and two["duration"] == pytest.approx(0.1)
    # Same total machine time: two machines for half as long cost the same per token.
    assert two["cost_per_million_output_tokens"] == pytest.approx(one["cost_per_million_output_tokens"])
    assert one["cost_per_million_output_tokens"] == pytest.approx(1.0 * 0.2 / 3600 / 20 * 1e6)


def test_round_robin_and_least_loaded_routing() -> None:
    # One slot per replica. r0 (10 tokens) goes to replica 0, r1 (2 tokens) to replica 1, done
    # by 0.02. r2 arrives at 0.05: round-robin puts it behind r0 (its prefill step ends at
    # 0.11); least-loaded puts it on the idle replica 1 (one step).
    requests = [SimRequest(prompt(4), 10, 0.0), SimRequest(prompt(4, 50), 2, 0.0), SimRequest(prompt(4, 90), 2, 0.05)]
    rr = simulate(requests, config(max_num_seqs=1), constant(), num_replicas=2, routing="round-robin", served=False)
    ll = simulate(requests, config(max_num_seqs=1), constant(), num_replicas=2, routing="least-loaded", served=False)
    assert rr.summary()["ttfts"][2] == pytest.approx(0.11 - 0.05)
    assert ll.summary()["ttfts"][2] == pytest.approx(0.01)


# ------------------------------------------------------------------ SLO choice


def test_parse_slo() -> None:
    assert parse_slo("ttft_p99_ms=500, tpot_p99_ms=80") == {"ttft_p99_ms": 500.0, "tpot_p99_ms": 80.0}
    assert parse_slo(None) == {}
    for bad in ("ttft=5", "ttft_p99_ms", "ttft_p99_ms=x", "tpot_p99_ms=0"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)


def test_cheapest_configuration_meeting_the_slo() -> None:
    calibration = Calibration(intercept_s=0.02, per_token_s=0.0005, per_seq_s=0.001, per_kv_token_s=1e-6)
    requests = mixed_requests()
    rows = [run_point(requests, config(), calibration, p, 1.0, served=False)
            for p in sweep_points([1, 4, 16], ["continuous", "static"], [1, 2])]
    loose = cheapest(rows, {})
    assert loose is not None and loose["cost_per_million_output_tokens"] == min(
        r["cost_per_million_output_tokens"] for r in rows)
    # A TTFT bound that only some configurations meet: the cheapest of those, and it meets it.
    bound = sorted(r["p99_ttft_ms"] for r in rows)[len(rows) // 3]
    slo = {"ttft_p99_ms": bound}
    choice = cheapest(rows, slo)
    assert choice is not None and choice["p99_ttft_ms"] <= bound
    assert all(r["cost_per_million_output_tokens"] >= choice["cost_per_million_output_tokens"]
               for r in rows if r["p99_ttft_ms"] <= bound)
    assert cheapest(rows, {"ttft_p99_ms": 0.001}) is None
    table = format_plan(rows, slo, choice)
    assert table.count("**<-**") == 1 and "Cheapest configuration meeting ttft_p99_ms" in table
    assert "No configuration meets" in format_plan(rows, {"ttft_p99_ms": 0.001}, None)


# ------------------------------------------------------------------ the cost model


def test_fit_recovers_exact_coefficients_and_stays_non_negative() -> None:
    truth = [0.004, 2e-4, 1e-3, 3e-6]
    shapes = [StepShape(t, s, k) for t, s, k in
              [(1, 1, 20), (8, 8, 400), (16, 16, 4000), (300, 1, 300), (64, 4, 900), (2048, 4, 2048), (32, 32, 9000)]]
    seconds = [sum(c * f for c, f in zip(truth, shape.features())) for shape in shapes]
    coefficients, error = fit_step_times(shapes, seconds)
    assert coefficients == pytest.approx(truth, rel=1e-6) and error < 1e-9
    # Times that fall with the token count would need a negative coefficient: it is held at 0.
    falling = [0.05 - 1e-5 * s.num_tokens for s in shapes]
    assert all(c >= 0 for c in fit_step_times(shapes, falling)[0])
    with pytest.raises(ValueError, match="at least 4"):
        fit_step_times(shapes[:3], seconds[:3])


def test_fit_recovers_a_piecewise_linear_token_term() -> None:
    # Decode batches of 1-32 rows and prefills: the kernels' cost per row changes at 8 rows and
    # falls back after 32 (a made-up machine): the knots' slope changes come back exactly.
    truth = [0.004, 5e-4, 2e-4, 2e-6, 0.0, 0.0, 8e-4, 0.0, -9e-4, 0.0]  # knots 2, 4, 8, 16, 32, 64
    shapes = [StepShape(n, n, kv * n + 7) for n in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 20, 24, 32, 33, 40, 48)
              for kv in (40, 300)]
    shapes += [StepShape(t, s, t + 50 * s) for t in (64, 96, 128, 200) for s in (1, 3)]
    knots = choose_knots(shapes)
    assert knots == (2, 4, 8, 16, 32, 64)
    seconds = [sum(c * f for c, f in zip(truth, shape.features(knots))) for shape in shapes]
    coefficients, error = fit_step_times(shapes, seconds, knots)
    assert coefficients == pytest.approx(truth, rel=1e-6, abs=1e-12) and error < 1e-9
    calibration = calibration_from_steps(shapes, seconds)
    assert {8, 32} <= set(calibration.token_knots)
    for shape, t in zip(shapes, seconds):
        assert calibration.step_time(shape, served=False) == pytest.approx(t)
    # A token term that would fall past a knot is held flat there, never negative.
    falling = [0.05 + 1e-3 * min(s.num_tokens, 16) - 1e-4 * max(s.num_tokens - 16, 0) for s in shapes]
    model = calibration_from_steps(shapes, falling)
    times = [model.step_time(StepShape(n, 1, 0), served=False) for n in range(1, 300)]
    assert all(b >= a - 1e-12 for a, b in zip(times, times[1:]))
    with pytest.raises(ValueError, match="must not fall"):
        Calibration(intercept_s=0.01, per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0, token_knots=(8,),
                    per_token_above_s=(-2e-4,))


def test_knots_need_measured_steps_on_each_side() -> None:
    assert choose_knots([StepShape(n, n, 0) for n in (1, 1, 1, 4, 4, 4)]) == (2,)
    assert choose_knots([StepShape(n, n, 0) for n in (1, 2, 3, 4, 5)]) == ()
    assert choose_knots([StepShape(n, 1, 0) for n in (1, 2, 3, 300, 400, 500)]) == (4,)


def test_calibration_file_round_trips(tmp_path: Path) -> None:
    shapes = [StepShape(n, s, 10 * n) for n, s in [(1, 1), (4, 4), (64, 2), (16, 16), (512, 1)]]
    calibration = calibration_from_steps(shapes, [0.01 + 1e-4 * s.num_tokens + 1e-3 * s.num_seqs for s in shapes],
                                         context_cost=0.0003, max_position_embeddings=8192, kv_bytes_per_token=46080,
                                         description={"host": "test"})
    path = tmp_path / "calib.json"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert loaded == calibration
    assert loaded.step_time(StepShape(8, 8, 80)) == pytest.approx(0.01 + 8e-4 + 8e-3)
    assert loaded.num_kv_blocks(EngineConfig(max_num_seqs=4, max_model_len=1024)) == 4 * 1024 // 16
    path.write_text(json.dumps({"version": CALIBRATION_VERSION, "intercept_s": -1.0, "per_token_s": 0, "per_seq_s": 0,
                                "per_kv_token_s": 0}))
    with pytest.raises(ValueError, match="calib.json.*intercept_s"):
        Calibration.load(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="calib.json"):
        Calibration.load(path)


def test_planner_arrivals_are_bench_serves() -> None:
    served = schedule_arrivals(MIXED, ServeBenchConfig(base_url="http://x", request_rate=2.0, seed=7))
    assert [r.arrival_s for r in at_rate(MIXED, 2.0, 1.0, 7)] == [r.arrival_s for r in served]
    assert all(r.arrival_s == 0 for r in at_rate(MIXED, math.inf))


def test_text_prompts_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        sim_requests(MIXED, None)
    ids = sim_requests([WorkloadRequest(max_tokens=3, prompt_token_ids=[5, 6, 7], arrival_time=1.5)], None)
    assert ids == [SimRequest([5, 6, 7], 3, 1.5)]


# ------------------------------------------------------------------ calibration on the real engine and the CLI


@pytest.fixture(scope="module")
def measured_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A calibration measured on the real default model, over a few small scenarios."""
    from backfill.bench.calibrate import Scenario, run_calibration

    scenarios = (Scenario(1, 8, 3, late_prompt_len=20), Scenario(4, 16, 3, late_prompt_len=20),
                 Scenario(2, 48, 2, shared=True, late_prompt_len=20))
    calibration = run_calibration(EngineConfig(dtype="float32", max_model_len=256), scenarios=scenarios)
    # Every step of every scenario was measured: prefill, decode, the shared prompt's reuse, the late prompt
    assert calibration.description["num_steps"] == len(calibration.samples) >= 3 * 4
    assert any(n > 1 and s > 1 for n, s, _, _ in calibration.samples)  # a mixed or batched prompt step
    assert calibration.intercept_s + calibration.per_token_s + calibration.per_seq_s > 0
    assert calibration.offline_step_s + calibration.offline_token_s > 0  # detokenizing costs something
    path = tmp_path_factory.mktemp("plan") / "calib.json"
    calibration.save(path)
    return path


def test_cli_plans_a_small_workload(measured_calibration: Path, tmp_path: Path) -> None:
    workload = tmp_path / "mixed.jsonl"
    save_workload(MIXED[:10], workload)
    result = tmp_path / "plan.json"
    command = [sys.executable, "-m", "backfill.entrypoints.cli", "plan", "--workload", str(workload),
               "--request-rate", "4", "--max-num-seqs", "2", "8", "--replicas", "1", "2",
               "--calibration", str(measured_calibration), "--slo", "ttft_p99_ms=100000",
               "--max-model-len", "256", "--plot", "--result-file", str(result)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(result.read_text())
    assert len(report["rows"]) == 2 * 2 * 2  # max_num_seqs x policies x replicas
    assert all(r["completed"] == 10 and r["total_output_tokens"] == sum(q.max_tokens for q in MIXED[:10])
               for r in report["rows"])
    assert report["choice"] is not None and "**<-**" in done.stdout
    assert (tmp_path / "plan.png").stat().st_size > 0
    bad = subprocess.run(command[:-2] + ["--slo", "ttft=1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "slo" in bad.stderr
    no_slots = subprocess.run([sys.executable, "-m", "backfill.entrypoints.cli", "plan", "calibrate", "--base-url",
                               "http://127.0.0.1:1", "--probe-num-slots", "0", "-o", str(tmp_path / "c.json")],
                              capture_output=True, text=True, timeout=300)
    assert no_slots.returncode == 2 and "--probe-num-slots must be >= 1" in no_slots.stderr
    assert not (tmp_path / "c.json").exists()


def test_cli_calibrates_when_the_file_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a calibration file the sweep calibrates first, saves it, then reuses it. (The
    calibration itself is replaced here: the full one takes minutes; the fixture above runs it.)"""
    import backfill.bench.calibrate as calibrate
    from backfill.bench import plan_cli

    calls: list[EngineConfig] = []

    def run_calibration(config: EngineConfig, show_progress: bool = False) -> Calibration:
        calls.append(config)
        return constant()

    monkeypatch.setattr(calibrate, "run_calibration", run_calibration)
    path = tmp_path / "new.json"
    assert plan_cli.load_or_calibrate(path, EngineConfig()) == constant()
    assert len(calls) == 1 and Calibration.load(path) == constant()
    assert plan_cli.load_or_calibrate(path, EngineConfig()) == constant() and len(calls) == 1
