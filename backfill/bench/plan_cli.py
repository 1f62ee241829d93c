"""`backfill plan ...`: the capacity planner's commands.

    backfill plan [workload and sweep options]      sweep configurations in simulation
    backfill plan calibrate -o calib.json           measure this machine's steps, fit, save
    backfill plan check                             the planner against real `bench serve` runs

The sweep needs no torch: it loads a saved calibration (or runs `calibrate` first when the file
is missing) and the model's tokenizer to count prompt tokens as the server does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from backfill.bench.cli import _add_spec_arguments, _rate, _workload_from_args, _write_json
from backfill.bench.cost_model import Calibration
from backfill.bench.simulator import ROUTINGS
from backfill.config import POLICIES, EngineConfig

DEFAULT_CALIBRATION = Path("bench_results") / "plan_calibration.json"


def add_plan_subparser(subparsers: Any) -> None:
    """Add `plan` (and `plan calibrate`, `plan check`) to an argparse sub-parser collection."""
    plan = subparsers.add_parser("plan", help="capacity planner: simulate configurations on a calibrated cost model")
    commands = plan.add_subparsers(dest="plan_command", required=False)
    _add_sweep_arguments(plan)

    calibrate = commands.add_parser("calibrate", help="time the engine's steps here and fit the cost model")
    calibrate.add_argument("--output", "-o", default=str(DEFAULT_CALIBRATION), help="calibration JSON to write")
    calibrate.add_argument("--base-url", default=None,
                           help="also probe this running server for the front end's delay and step slowdown")
    calibrate.add_argument("--probe-num-slots", type=int, default=None,
                           help="the probed server's --max-num-seqs (default: read from its /v1/stats)")
    calibrate.add_argument("--probe-api-key", default=None, help="the probed server's API key, if it has one")
    EngineConfig.add_cli_args(calibrate, exclude=("policy", "max_num_seqs", "seed"))

    from backfill.bench.plan_check import add_check_arguments

    add_check_arguments(commands.add_parser("check", help="predicted vs measured: real servers and bench serve / compare"))


def _add_sweep_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--workload", default=None, help="JSON-lines workload (as bench serve takes); default: generate one")
    plan.add_argument("--request-rate", type=_rate, default=None,
                      help="requests/s with seeded Poisson/gamma arrivals, as `bench serve --request-rate` "
                           "(inf: all at once). Default: the workload's arrival times")
    plan.add_argument("--burstiness", type=float, default=1.0, help="as bench serve's")
    plan.add_argument("--serve-seed", type=int, default=0, help="bench serve's --seed (the drawn arrivals)")
    plan.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 8, 16, 32], dest="sweep_max_num_seqs")
    plan.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    plan.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    plan.add_argument("--routing", choices=ROUTINGS, default="least-loaded", help="how arrivals split over replicas")
    plan.add_argument("--slo", default=None, help="e.g. ttft_p99_ms=1000,tpot_p99_ms=100: pick the cheapest that meets it")
    plan.add_argument("--price-per-hour", type=float, default=1.0, help="USD per hour of one machine (one replica)")
    plan.add_argument("--calibration", default=str(DEFAULT_CALIBRATION),
                      help="calibration JSON (made by `plan calibrate`; made here first when missing)")
    plan.add_argument("--offline", action="store_true",
                      help="the engine in-process (bench offline / compare): no front end, steps unscaled")
    plan.add_argument("--result-file", default=None, help="JSON to write (the PNG goes next to it)")
    plan.add_argument("--plot", action="store_true", help="draw throughput, latency and cost per configuration")
    _add_spec_arguments(plan)
    # The engine settings the simulated scheduler shares with the server (budgets, block size,
    # context length, prefix caching); the model's tokenizer counts prompt tokens.
    EngineConfig.add_cli_args(plan, exclude=("policy", "max_num_seqs", "seed"))


def load_or_calibrate(path: str | Path, config: EngineConfig) -> Calibration:
    """The saved calibration at `path`; when there is none, calibrate now and save it there."""
    if Path(path).exists():
        return Calibration.load(path)
    from backfill.bench.calibrate import run_calibration

    print(f"no calibration at {path}: calibrating this machine (a minute or two)", flush=True)
    calibration = run_calibration(config, show_progress=True)
    calibration.save(path)
    print(f"wrote {path}")
    return calibration


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from backfill.bench.calibrate import probe_server, run_calibration

    if args.probe_num_slots is not None and args.probe_num_slots < 1:
        raise ValueError(f"--probe-num-slots must be >= 1, got {args.probe_num_slots}")
    config = EngineConfig.from_cli_args(args)
    calibration = run_calibration(config, show_progress=True)
    if args.base_url:
        calibration = probe_server(args.base_url, calibration, config, args.probe_num_slots, args.probe_api_key)
    calibration.save(args.output)
    print(format_calibration(calibration))
    print(f"wrote {args.output}")
    return 0


def format_calibration(c: Calibration) -> str:
    fit = c.description.get("median_relative_fit_error")
    lines = [
        f"step time = {1000 * c.intercept_s:.2f} ms + {1e6 * c.per_token_s:.1f} us/token "
        f"+ {1e6 * c.per_seq_s:.1f} us/sequence + {1e9 * c.per_kv_token_s:.1f} ns/KV token read"
        + "".join(f" {1e6 * change:+.1f} us/token above {knot}" for knot, change in
                  zip(c.token_knots, c.per_token_above_s)),
        f"fitted on {c.description.get('num_steps', len(c.samples))} steps"
        + (f", median relative error {100 * fit:.1f}%" if fit is not None else ""),
        f"served: front end {1000 * c.frontend_s:.1f} ms per request, steps x{c.served_step_factor:.2f}",
    ]
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    from backfill.bench.planner import cheapest, format_plan, parse_slo, run_point, sim_requests, sweep_points
    from backfill.bench.workloads import at_rate

    slo = parse_slo(args.slo)
    points = sweep_points(args.sweep_max_num_seqs, args.policies, args.replicas)
    if args.price_per_hour < 0:
        raise ValueError(f"--price-per-hour: must be >= 0, got {args.price_per_hour}")
    base = EngineConfig.from_cli_args(args)
    calibration = load_or_calibrate(args.calibration, base)
    requests = _workload_from_args(args)
    if args.request_rate is not None:
        requests = at_rate(requests, args.request_rate, args.burstiness, args.serve_seed)
    encode = None
    if any(r.prompt is not None for r in requests):
        from backfill.tokenizer import load_tokenizer

        encode = load_tokenizer(base.model).encode
    sims = sim_requests(requests, encode)
    rows = [run_point(sims, base, calibration, p, args.price_per_hour, args.routing, not args.offline) for p in points]
    choice = cheapest(rows, slo)
    print(format_calibration(calibration))
    print(format_plan(rows, slo, choice))
    path = Path(args.result_file) if args.result_file else _default_path()
    report = {"argv": sys.argv, "slo": slo, "calibration": args.calibration, "served": not args.offline,
              "choice": None if choice is None else rows.index(choice),
              "rows": [{k: v for k, v in r.items() if k not in ("ttfts", "e2els")} for r in rows]}
    _write_json(path, report)
    if args.plot:
        from backfill.bench.plots import plot_plan

        print(f"wrote {plot_plan(rows, slo, choice, path.with_name(path.stem + '.png'))}")
    return 0


def _default_path() -> Path:
    from datetime import datetime

    return Path("bench_results") / f"plan-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def run_plan(args: argparse.Namespace) -> int:
    """Run `backfill plan [calibrate | check]`; returns the process exit code."""
    from backfill.bench.plots import MissingExtraError, require_matplotlib

    try:
        if getattr(args, "plot", False):
            require_matplotlib()
        if args.plan_command == "calibrate":
            return _cmd_calibrate(args)
        if args.plan_command == "check":
            from backfill.bench.plan_check import run_check

            return run_check(args)
        return _cmd_plan(args)
    except (ValueError, FileNotFoundError, MissingExtraError) as error:
        print(f"backfill plan: {error}", file=sys.stderr)
        return 2
