"""`backfill plan check`: the planner's predictions against real measurements, end to end.

1. The calibration (made here when missing, or with --recalibrate): the engine's steps in
   this process, then a probe of a server of its own (max_num_seqs PROBE_SLOTS) for the
   front end's terms.
2. For each --max-num-seqs: a real `backfill serve --max-num-seqs N` on loopback (other flags at
   their defaults); `bench serve` replays the
   workload at each --request-rate (seeded arrivals, as the planner draws them); the planner
   predicts the same run. Output throughput must be within 15%, median TTFT and TPOT within 25%.
3. `bench compare` (continuous and static, in-process) on the workload as written; the
   planner's continuous / static throughput ratio (in-process: no front end) must be within
   15% of the measured one.
With --probe-each-run, step 2 first probes each run's own server (the same probe as in 1, on
that server's slots) and predicts that run from the probed calibration: the machine's speed
drifts by 10-25% within minutes (a VM's neighbours come and go), so this checks the model
against the machine as it is when the run starts. The prediction never sees the run itself.
Prints a predicted-vs-measured markdown table with pass/fail; exits 1 when any row fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from backfill.bench.cli import _add_spec_arguments, _rate, _workload_from_args, _write_json
from backfill.bench.cost_model import Calibration
from backfill.bench.local_server import local_server
from backfill.bench.planner import PlanPoint, run_point, sim_requests
from backfill.bench.workloads import WorkloadRequest, at_rate, save_workload
from backfill.config import EngineConfig

THROUGHPUT_TOLERANCE = 0.15
LATENCY_TOLERANCE = 0.25
RATIO_TOLERANCE = 0.15
# Above this 1-minute load average after a run (2 cores: the server, the client and the engine
# steps' threads already make ~2), something else ran: the check says so.
BUSY_LOAD_AVERAGE = 3.0


def add_check_arguments(check: argparse.ArgumentParser) -> None:
    check.add_argument("--workload", default=None, help="JSON-lines workload (default: generate the mixed one)")
    check.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 16], dest="check_max_num_seqs")
    check.add_argument("--request-rates", type=_rate, nargs="+", default=[2.0, math.inf],
                       help="bench serve's --request-rate values (inf: all at once)")
    check.add_argument("--compare-batch-size", type=int, default=16, help="bench compare's --batch-size")
    check.add_argument("--compare-repeats", type=int, default=1, help="bench compare's --repeats (0: skip compare)")
    check.add_argument("--calibration", default="bench_results/plan_calibration.json")
    check.add_argument("--recalibrate", action="store_true", help="calibrate and probe even if the file exists")
    check.add_argument("--probe-each-run", action="store_true",
                       help="probe each run's own server just before it and predict the run from that probe")
    check.add_argument("--compare-max-model-len", type=int, default=1024, help="bench compare's --max-model-len")
    check.add_argument("--port", type=int, default=0, help="the servers' port (0: a free one)")
    check.add_argument("--num-threads", type=int, default=None,
                       help="torch threads of every engine (calibration, servers, compare); default: torch's")
    check.add_argument("--result-file", default="bench_results/plan_check.json")
    _add_spec_arguments(check)


def _row(config: str, metric: str, predicted: float, measured: float, tolerance: float) -> dict[str, Any]:
    error = predicted / measured - 1 if measured else math.inf
    return {"config": config, "metric": metric, "predicted": predicted, "measured": measured,
            "error": error, "tolerance": tolerance, "pass": abs(error) <= tolerance}


def format_check(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | figure | predicted | measured | error | limit | |",
             "|:---|:---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['metric']} | {r['predicted']:.2f} | {r['measured']:.2f} | "
                     f"{100 * r['error']:+.1f}% | ±{100 * r['tolerance']:.0f}% | {'pass' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def _serve_rows(requests: list[WorkloadRequest], calibration: Calibration, max_num_seqs: int, rate: float,
                measured: dict[str, Any], encode: Any) -> list[dict[str, Any]]:
    sims = sim_requests(at_rate(requests, rate), encode)
    predicted = run_point(sims, EngineConfig(), calibration, PlanPoint(max_num_seqs, "continuous"), 1.0)
    name = f"serve, max_num_seqs {max_num_seqs}, {'all at once' if math.isinf(rate) else f'{rate:g} req/s'}"
    return [
        _row(name, "output tok/s", predicted["output_throughput"], measured["output_throughput"], THROUGHPUT_TOLERANCE),
        _row(name, "median TTFT (ms)", predicted["median_ttft_ms"], measured["median_ttft_ms"], LATENCY_TOLERANCE),
        _row(name, "median TPOT (ms)", predicted["median_tpot_ms"], measured["median_tpot_ms"], LATENCY_TOLERANCE),
    ]


def run_check(args: argparse.Namespace) -> int:
    from backfill.bench.calibrate import PROBE_SLOTS, probe_server, run_calibration
    from backfill.bench.serve_client import ServeBenchConfig, run_serve_benchmark
    from backfill.tokenizer import load_tokenizer

    Path("bench_results").mkdir(exist_ok=True)
    requests = _workload_from_args(args)
    save_workload(requests, Path(args.result_file).with_suffix(".workload.jsonl"))
    fresh = args.recalibrate or not Path(args.calibration).exists()
    engine = EngineConfig(num_threads=args.num_threads)
    calibration = run_calibration(engine, show_progress=True) if fresh else Calibration.load(args.calibration)
    encode = load_tokenizer(None).encode
    rows: list[dict[str, Any]] = []
    measured_runs: dict[str, Any] = {}
    single_rows: list[dict[str, Any]] = []
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads is not None else []
    if fresh:  # the probe's own server: room for its largest batch, its prefix cache apart
        probe_flags = ["--max-num-seqs", str(PROBE_SLOTS), *threads]
        with local_server(probe_flags, Path("bench_results") / "plan_check_server_probe.log", args.port) as url:
            calibration = probe_server(url, calibration, engine, PROBE_SLOTS)
        calibration.save(args.calibration)
        print(f"wrote {args.calibration}", flush=True)
    for max_num_seqs in args.check_max_num_seqs:
        flags = ["--max-num-seqs", str(max_num_seqs), *threads]
        for rate in args.request_rates:
            # NOTE: a fresh server for every run: a second replay of the same prompts would find
            # them in the prefix cache, which the simulation (starting empty) does not model.
            log = Path("bench_results") / f"plan_check_server_{max_num_seqs}_{rate:g}.log"
            predictor = calibration
            with local_server(flags, log, args.port) as url:
                if args.probe_each_run:  # NOTE: the probe's prompts share no prefix with the workload's
                    predictor = probe_server(url, calibration, engine, max_num_seqs)
                measured = run_serve_benchmark(requests, ServeBenchConfig(base_url=url, request_rate=rate,
                                                                          show_progress=False))
            load = os.getloadavg()[0]
            measured_runs[f"{max_num_seqs}@{rate}"] = {
                **{k: v for k, v in measured.items() if not isinstance(v, list)}, "load_average_1m_after": load,
                "served_step_factor": predictor.served_step_factor, "frontend_s": predictor.frontend_s}
            rows += _serve_rows(requests, predictor, max_num_seqs, rate, measured, encode)
            if args.probe_each_run:  # the same run predicted from the one calibration, for the record
                single_rows += _serve_rows(requests, calibration, max_num_seqs, rate, measured, encode)
            print(format_check(rows[-3:]), flush=True)
            if load > BUSY_LOAD_AVERAGE:
                print(f"NOTE: load average {load:.1f} after this run: other work shared the machine, "
                      "the measured figures are not this server's alone", flush=True)
    if args.compare_repeats > 0:
        rows.append(_compare_row(requests, calibration, args, encode, measured_runs))
    if single_rows:
        print("predicted from the one calibration (not probed before each run):")
        print(format_check(single_rows))
        print("predicted from each run's own probe:")
    print(format_check(rows))
    _write_json(Path(args.result_file), {"argv": sys.argv, "calibration": args.calibration, "rows": rows,
                                         "rows_one_calibration": single_rows, "measured": measured_runs})
    return 0 if all(r["pass"] for r in rows) else 1


def _compare_row(requests: list[WorkloadRequest], calibration: Calibration, args: argparse.Namespace, encode: Any,
                 measured_runs: dict[str, Any]) -> dict[str, Any]:
    """`bench compare --systems continuous static` vs the planner's in-process prediction."""
    from backfill.bench.compare import CompareConfig, run_compare
    from backfill.bench.simulator import simulate

    engine = EngineConfig(max_num_seqs=args.compare_batch_size, max_model_len=args.compare_max_model_len,
                          num_threads=args.num_threads)
    report, _ = run_compare(requests, CompareConfig(engine=engine, repeats=args.compare_repeats,
                                                    systems=("continuous", "static"), show_progress=False))
    measured = report["ratios"]["continuous_vs_static_output_throughput"]
    measured_runs["compare"] = report["medians"]
    sims = sim_requests(requests, encode)
    throughput = {policy: simulate(sims, replace(engine, policy=policy), calibration,
                                   served=False).summary()["output_throughput"] for policy in ("continuous", "static")}
    name = f"compare, batch {args.compare_batch_size}"
    return _row(name, "continuous / static output tok/s", throughput["continuous"] / throughput["static"], measured,
                RATIO_TOLERANCE)
