"""`backfill bench ...`: workload | serve | offline | compare | roofline | structured | divergence.

The `backfill` CLI calls `add_bench_subparser` and `run_bench`; `python -m backfill.bench.cli`
runs the same commands on their own. Heavy imports (torch, the engine) happen inside the
command that needs them: `bench serve` and `bench workload` never load a model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backfill.bench.divergence import VARIANTS
from backfill.bench.plots import MissingExtraError, require_matplotlib
from backfill.bench.workloads import ARRIVAL_KINDS, WORKLOAD_KINDS, WorkloadRequest, WorkloadSpec
from backfill.config import POLICIES, EngineConfig

if TYPE_CHECKING:
    from backfill.bench.compare import CompareConfig

logger = logging.getLogger(__name__)

DEFAULT_RESULTS_DIR = Path("bench_results")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generated workload (used when no --workload file is given)")
    group.add_argument("--num-requests", type=int, default=64)
    group.add_argument("--kind", choices=WORKLOAD_KINDS, default="mixed")
    group.add_argument("--short-share", type=float, default=0.5, help="mixed: share of short requests")
    group.add_argument("--short-tokens", type=int, nargs=2, default=(2, 8), metavar=("MIN", "MAX"))
    group.add_argument("--long-tokens", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    group.add_argument("--uniform-tokens", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    group.add_argument("--prompt-words", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    group.add_argument("--arrival", choices=ARRIVAL_KINDS, default="all-at-once")
    group.add_argument("--arrival-rate", type=_rate, default=1.0, help="poisson/gamma: requests per second")
    group.add_argument("--arrival-burstiness", type=float, default=1.0, help="gamma shape (<1 burstier)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--long-prompt-words", type=int, default=6000, help="long-prompt: words of the long prompt")
    group.add_argument("--long-prompt-arrival", type=float, default=2.0, help="long-prompt: its arrival (s)")
    group.add_argument("--system-prompt-tokens", type=int, default=512,
                       help="shared-prefix / multi-turn: tokens of the system prompt every request starts with")
    group.add_argument("--num-prefixes", type=int, default=1,
                       help="shared-prefix / multi-turn: distinct system prompts, spread evenly and shuffled")
    group.add_argument("--user-tokens", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                       help="shared-prefix / multi-turn: tokens of each user turn")
    group.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 20000), metavar=("MIN", "MAX"),
                       help="shared-prefix / multi-turn: prompt token ids are drawn from this range")
    group.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    group.add_argument("--turn-interval", type=float, default=10.0, help="multi-turn: seconds between turns")


def _spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=args.num_requests, kind=args.kind, short_share=args.short_share,
        short_tokens=tuple(args.short_tokens), long_tokens=tuple(args.long_tokens),
        uniform_tokens=tuple(args.uniform_tokens), prompt_words=tuple(args.prompt_words),
        arrival=args.arrival, request_rate=args.arrival_rate, burstiness=args.arrival_burstiness, seed=args.seed,
        long_prompt_words=args.long_prompt_words, long_prompt_arrival=args.long_prompt_arrival,
        system_prompt_tokens=args.system_prompt_tokens,
        num_prefixes=args.num_prefixes, user_tokens=tuple(args.user_tokens),
        token_id_range=tuple(args.token_id_range), num_turns=args.num_turns, turn_interval=args.turn_interval,
    )


def _workload_from_args(args: argparse.Namespace) -> list[WorkloadRequest]:
    from backfill.bench.workloads import generate_workload, load_workload

    if getattr(args, "workload", None):
        return load_workload(args.workload)
    return generate_workload(_spec_from_args(args))


def _add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...]) -> None:
    """The engine flags (EngineConfig.add_cli_args) but those the command sets itself, with the
    benchmarks' context cap; --num-threads holds for every system of the run."""
    from backfill.bench.offline import DEFAULT_MAX_MODEL_LEN

    EngineConfig.add_cli_args(parser, exclude=exclude)
    parser.set_defaults(max_model_len=DEFAULT_MAX_MODEL_LEN)


def add_bench_subparser(subparsers: Any) -> None:
    """Add `bench` and its sub-commands to an argparse sub-parser collection."""
    bench = subparsers.add_parser("bench", help="measure throughput, latency and slot use")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    workload = commands.add_parser("workload", help="write a seeded workload as JSON lines")
    workload.add_argument("--output", "-o", required=True, help="JSON-lines file to write")
    _add_spec_arguments(workload)

    serve = commands.add_parser("serve", help="replay a workload against an OpenAI-compatible server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--workload", required=True, help="JSON-lines workload file")
    # Not the engine's --model (no engine runs here): the model name each request names.
    serve.add_argument("--model", dest="request_model", default=None,
                       help="model name to send (default: the server's first)")
    serve.add_argument("--endpoint", default="/v1/completions")
    serve.add_argument("--request-rate", type=_rate, nargs="+", default=None,
                       help="requests/s (inf: all at once); several values run a sweep. Default: the workload's arrival times")
    serve.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    serve.add_argument("--seed", type=int, default=0, help="seeds the drawn arrivals")
    serve.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    serve.add_argument("--percentiles", type=float, nargs="+", default=[50.0, 99.0])
    serve.add_argument("--result-file", default=None, help="JSON to write (a sweep adds -rate<R> to the name)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--num-warmups", type=int, default=1)
    serve.add_argument("--num-slots", type=int, default=None,
                       help="the server's batch slots (max-num-seqs), to estimate idle-slot cost")
    serve.add_argument("--price-per-hour", type=float, default=None, help="USD per hour of the machine")
    serve.add_argument("--dashboard", choices=("closed", "open", "both"), default="closed",
                       help="open: the server's /dashboard is open in a headless Chromium during the run; "
                            "both: each rate runs closed, then open, and the throughput ratio is printed")
    serve.add_argument("--plot", action="store_true", help="write throughput/TTFT-vs-rate and latency CDF PNGs")
    serve.add_argument("--label", default="server", help="series name in plots")
    serve.add_argument("--no-progress", action="store_true")

    offline = commands.add_parser("offline", help="run the engine in-process on a workload")
    offline.add_argument("--workload", default=None, help="JSON-lines workload (default: generate one)")
    # Not the engine's --policy: which policies to run, one engine each (so the engine's is left out).
    offline.add_argument("--policy", dest="policies", choices=(*POLICIES, "both"), default="both",
                         help="the engine policy to run, or both one after the other")
    offline.add_argument("--repeats", type=int, default=1)
    # The workload's --seed is the one this command takes.
    _add_engine_arguments(offline, exclude=("policy", "static_padding", "seed"))
    offline.set_defaults(max_num_seqs=16)
    _add_common_report_arguments(offline)
    _add_spec_arguments(offline)

    compare = commands.add_parser("compare", help="backfill continuous vs static vs transformers generate()")
    compare.add_argument("--workload", default=None, help="JSON-lines workload (default: generate one)")
    compare.add_argument("--batch-size", type=int, default=16,
                         help="every system's batch: backfill's max_num_seqs, generate()'s batch size")
    compare.add_argument("--repeats", type=int, default=3)
    from backfill.bench.compare import DEFAULT_SYSTEMS, SYSTEMS

    compare.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                         help="static: fixed-shape batches (finished slots computed as padding); "
                              "static_compact: finished slots skipped; hf: transformers generate()")
    # --systems sets the policy and padding, --batch-size max_num_seqs, --seed is the workload's.
    _add_engine_arguments(compare, exclude=("policy", "static_padding", "max_num_seqs", "seed"))
    _add_common_report_arguments(compare)
    _add_spec_arguments(compare)

    structured = commands.add_parser("structured", help="constrained decoding's cost: a batch with and without JSON schemas")
    structured.add_argument("--batch-size", type=int, default=32)
    structured.add_argument("--max-tokens", type=int, default=128)
    structured.add_argument("--fraction", type=float, default=0.5, help="share of the batch constrained")
    structured.add_argument("--repeats", type=int, default=3)
    structured.add_argument("--result-file", default=None)
    _add_engine_arguments(structured, exclude=("policy", "static_padding", "max_num_seqs"))

    roofline = commands.add_parser("roofline", help="measure this machine's limits and the ideal decode step")
    roofline.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    roofline.add_argument("--context-len", type=int, default=128, help="tokens of context per sequence")
    roofline.add_argument("--measure-steps", type=int, default=8,
                          help="decode steps to time per batch size with the engine (0: skip)")
    roofline.add_argument("--buffer-mb", type=int, default=1024, help="bandwidth test buffer (exceed the L3 cache)")
    roofline.add_argument("--repeats", type=int, default=5,
                          help="rounds of (machine, then every batch size's steps), side by side; figures are "
                               "the medians over the rounds, and the ratio the median of each round's own")
    roofline.add_argument("--result-file", default=None)
    # The measured engine runs every batch size with prompts in as fast as they come.
    _add_engine_arguments(roofline, exclude=("policy", "static_padding", "max_num_seqs", "prefill_budget"))

    divergence = commands.add_parser(
        "divergence", help="what --activation-quantization int8 or a 16-bit --kv-cache-dtype changes: greedy "
                           "agreement and logit error vs the exact fp32 path")
    divergence.add_argument("--variant", choices=tuple(VARIANTS),
                            default="int8-activations",
                            help="the opt-in path measured against the exact one")
    divergence.add_argument("--num-prompts", type=int, default=32)
    divergence.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    divergence.add_argument("--prompt-words", type=int, nargs=2, default=[8, 160], metavar=("MIN", "MAX"),
                            help="words per prompt, drawn uniformly")
    divergence.add_argument("--result-file", default=None)
    _add_engine_arguments(divergence, exclude=("policy", "static_padding", "activation_quantization", "kv_cache_dtype",
                                               "device", "dtype"))


def _add_common_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result-file", default=None, help="JSON to write (PNGs go next to it)")
    parser.add_argument("--plot", action="store_true", help="write the slot timeline and latency CDF PNGs")
    parser.add_argument("--price-per-hour", type=float, default=None, help="USD per hour of the machine")
    parser.add_argument("--no-roofline", action="store_true", help="skip measuring the machine's roofline")
    parser.add_argument("--no-progress", action="store_true")


def _write_json(path: Path, data: dict[str, Any], quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default, allow_nan=True) + "\n")
    if not quiet:
        print(f"wrote {path}")


def _json_default(value: Any) -> Any:
    if hasattr(value, "__dict__"):
        return value.__dict__
    return str(value)


def _result_path(args: argparse.Namespace, stem: str) -> Path:
    if args.result_file:
        return Path(args.result_file)
    from datetime import datetime

    return DEFAULT_RESULTS_DIR / f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def _cmd_workload(args: argparse.Namespace) -> int:
    from backfill.bench.workloads import describe_workload, generate_workload, save_workload

    requests = generate_workload(_spec_from_args(args))
    save_workload(requests, args.output)
    print(json.dumps(describe_workload(requests)))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from backfill.bench.economics import estimate_wasted_share, format_economics, unit_economics
    from backfill.bench.metrics import RequestResult, format_summary, parse_goodput
    from backfill.bench.serve_client import ServeBenchConfig
    from backfill.bench.workloads import load_workload

    requests = load_workload(args.workload)
    slo = parse_goodput(args.goodput)
    rates: list[float | None] = list(args.request_rate) if args.request_rate else [None]
    base = _result_path(args, "serve")
    results = []
    for rate, page_open in _serve_runs(rates, args.dashboard):
        config = ServeBenchConfig(
            base_url=args.base_url, model=args.request_model, endpoint=args.endpoint, request_rate=rate,
            burstiness=args.burstiness, seed=args.seed, goodput_slo_ms=slo, percentiles=tuple(args.percentiles),
            api_key=args.api_key, num_warmups=args.num_warmups, show_progress=not args.no_progress,
        )
        result = _run_with_dashboard(requests, config, page_open)
        print(format_summary(result))
        delta = result["server_generation_tokens_delta"]
        if delta is not None:
            status = "matches" if int(delta) == result["total_output_tokens"] else "DOES NOT match"
            print(f"server /metrics generation tokens delta: {delta:.0f} ({status} the {result['total_output_tokens']} received)")
        server_rate = result["server_prefix_cache_hit_rate"]
        if server_rate is not None:
            print(f"server /metrics prefix cache hit rate: {100 * server_rate:.2f}% "
                  f"(from the responses' usage: {100 * result['prefix_cache_hit_rate']:.2f}%)")
        if args.price_per_hour is not None:
            wasted = None
            if args.num_slots:
                intervals = [RequestResult(success=not error, start_time=start, latency=e2el)
                             for error, start, e2el in zip(result["errors"], result["start_times"], result["e2els"])]
                wasted = estimate_wasted_share(intervals, args.num_slots, result["duration"])
            econ = unit_economics(args.price_per_hour, result["duration"], result["total_output_tokens"], wasted,
                                  "client-side estimate from in-flight requests" if wasted is not None else "")
            result["economics"] = econ
            print(format_economics(econ))
        path = base if len(rates) == 1 else base.with_name(f"{base.stem}-rate{_rate_name(rate)}{base.suffix}")
        if page_open:
            path = path.with_name(f"{path.stem}-dashboard{path.suffix}")
            if args.dashboard == "both":
                closed = results[-1]["output_throughput"]
                print(f"output throughput with /dashboard open: {result['output_throughput']:.2f} tok/s, closed: "
                      f"{closed:.2f} tok/s, ratio {result['output_throughput'] / closed:.4f}")
        _write_json(path, result)
        results.append(result)
    if args.plot:
        from backfill.bench.plots import plot_latency_cdf, plot_rate_sweep

        print(f"wrote {plot_rate_sweep({args.label: results}, base.with_name(base.stem + '_rate_sweep.png'))}")
        cdf = {f"{args.label} @ {r['request_rate']}": {"ttft": r["ttfts"], "e2el": r["e2els"]} for r in results}
        print(f"wrote {plot_latency_cdf(cdf, base.with_name(base.stem + '_latency_cdf.png'))}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


def _serve_runs(rates: list[float | None], dashboard: str) -> list[tuple[float | None, bool]]:
    """(rate, whether the dashboard is open) of each run, in order."""
    modes = {"closed": (False,), "open": (True,), "both": (False, True)}[dashboard]
    return [(rate, page_open) for rate in rates for page_open in modes]


def _run_with_dashboard(requests: list[Any], config: Any, page_open: bool) -> dict[str, Any]:
    """One serve benchmark run, with the server's /dashboard open (and polling) throughout if
    `page_open`: what a watching page costs the engine."""
    from backfill.bench.serve_client import run_serve_benchmark

    if not page_open:
        return run_serve_benchmark(requests, config)
    from backfill.bench.dashboard_browser import num_polls, open_dashboard

    with open_dashboard(config.base_url, config.api_key) as driver:
        polls_before = num_polls(driver)
        result = run_serve_benchmark(requests, config)
        result["dashboard_polls"] = num_polls(driver) - polls_before
        result["dashboard_status"] = driver.find_element("id", "status").text
    print(f"/dashboard polled /v1/stats {result['dashboard_polls']} times during the run "
          f"({result['dashboard_status']})")
    return result


def _rate_name(rate: float | None) -> str:
    if rate is None:
        return "workload"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _set_threads(args: argparse.Namespace) -> None:
    """One thread count for every system in the run (the engine, transformers, the roofline)."""
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)


def _measure_roofline(args: argparse.Namespace) -> tuple[Any, Any] | None:
    if getattr(args, "no_roofline", False):
        return None
    from backfill.bench.roofline import format_machine, load_model_shape, measure_machine

    machine = measure_machine(args.device)
    print(format_machine(machine))
    return machine, load_model_shape(args.model)


def _cmd_offline(args: argparse.Namespace) -> int:
    from backfill.bench.compare import CompareConfig

    policies = POLICIES if args.policies == "both" else (args.policies,)
    return _run_comparison(args, CompareConfig(
        engine=EngineConfig.from_cli_args(args), repeats=args.repeats, systems=policies,
        price_per_hour=args.price_per_hour, show_progress=not args.no_progress), "offline")


def _cmd_compare(args: argparse.Namespace) -> int:
    from backfill.bench.compare import CompareConfig

    return _run_comparison(args, CompareConfig(
        engine=EngineConfig.from_cli_args(args, max_num_seqs=args.batch_size), repeats=args.repeats,
        systems=tuple(args.systems), price_per_hour=args.price_per_hour, show_progress=not args.no_progress),
        "compare")


def _run_comparison(args: argparse.Namespace, config: CompareConfig, stem: str) -> int:
    """Shared by `offline` (backfill policies only) and `compare` (with the transformers baseline)."""
    from backfill.bench.compare import SYSTEM_LABELS, format_compare, run_compare
    from backfill.bench.offline import format_step_roofline

    requests = _workload_from_args(args)
    _set_threads(args)
    roofline = _measure_roofline(args)
    machine, shape = roofline if roofline else (None, None)
    path = _result_path(args, stem)
    partial = path.with_name(path.stem + ".partial.json")
    report, shown_runs = run_compare(requests, config, machine, shape,
                                     checkpoint=lambda so_far: _write_json(partial, so_far, quiet=True))
    partial.unlink(missing_ok=True)
    report["argv"] = sys.argv
    print(format_compare(report))
    for name, summary in report["medians"].items():
        repeat = summary.get("representative_repeat", 0)
        rows = report["runs"][name][repeat].get("decode_steps_by_batch")
        if rows:
            print(f"\n{name}: roofline efficiency {summary.get('roofline_efficiency', 0):.2f} "
                  f"(sum of ideal step times / sum of measured); decode steps of repeat {repeat + 1} (the median):")
            print(format_step_roofline(rows))
    _write_json(path, report)
    if args.plot:
        from backfill.bench.plots import plot_latency_cdf, plot_slot_timeline

        shown = [n for n in ("static", "static_compact", "continuous") if n in shown_runs]
        timelines = {SYSTEM_LABELS[n]: [s.slot_states for s in shown_runs[n].step_stats] for n in shown}
        if timelines:
            durations = {SYSTEM_LABELS[n]: shown_runs[n].duration for n in shown}
            ids = {SYSTEM_LABELS[n]: [s.slot_request_ids for s in shown_runs[n].step_stats] for n in shown}
            out = plot_slot_timeline(timelines, path.with_name(path.stem + "_slot_timeline.png"), durations, ids)
            print(f"wrote {out}")
        cdf = {SYSTEM_LABELS[n]: {"ttft": [r.ttft for r in run_.results if r.success],
                                  "e2el": [r.latency for r in run_.results if r.success]}
               for n, run_ in shown_runs.items()}
        print(f"wrote {plot_latency_cdf(cdf, path.with_name(path.stem + '_latency_cdf.png'))}")
    return 0


def _cmd_roofline(args: argparse.Namespace) -> int:
    from backfill.bench.roofline import (decode_roofline, describe_host, engine_model_shape, format_machine,
                                         format_roofline_table, load_model_shape, measure_machine, median_machine,
                                         median_rounds, resolve_dtype)

    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    _set_threads(args)
    shape = load_model_shape(args.model)
    dtype = resolve_dtype(args.dtype, args.device, args.quantization)
    engine = None
    if args.measure_steps > 0:
        from backfill.bench.offline import make_engine, measure_decode_step, warm_up

        max_len = max(args.max_model_len, args.context_len + args.measure_steps + 8)
        # decode steps are timed: prompts go in as fast as they can (no prefill budget)
        engine = make_engine(EngineConfig.from_cli_args(args, max_num_seqs=max(args.batch_sizes),
                                                        max_model_len=max_len, prefill_budget=0))
        shape, dtype = engine_model_shape(shape, engine)
        warm_up(engine)
    print(f"model {shape.name}: {shape.num_params / 1e6:.1f} M parameters, computed in {dtype}, "
          f"{shape.weight_bytes(dtype) / 1e6:.1f} MB of weights read per step")
    if shape.kv_dtype not in (None, dtype):
        print(f"KV cache in {shape.kv_dtype}: {shape.kv_bytes_per_token(dtype)} bytes a token of context")
    if args.activation_quantization != "none":
        print(f"activations quantized ({args.activation_quantization}) for the 4-bit linears: integer dot products, "
              "so the compute bound below (fp32 FMAs) does not bound these steps")
    # Each round measures the machine, then the steps right after it: on a shared machine both
    # move with the neighbours' load, so each round's ratio compares one moment with itself.
    machines, rounds = [], []
    for i in range(args.repeats):
        machine = measure_machine(args.device, buffer_mb=args.buffer_mb)
        measured: dict[int, float] = {}
        if engine is not None:
            for batch in args.batch_sizes:
                measured[batch] = measure_decode_step(engine, batch, args.context_len, args.measure_steps)
        rows = decode_roofline(shape, machine, dtype, args.batch_sizes, args.context_len, measured)
        machines.append(machine)
        rounds.append({"machine": machine.to_json(), "rows": rows})
        steps = ", ".join(f"batch {r['batch_size']} {r['measured_ms']:.1f} ms ({r['measured_over_ideal']:.2f}x)"
                          for r in rows if "measured_ms" in r)
        print(f"round {i + 1}/{args.repeats}: {format_machine(machine)}" + (f"\n  {steps}" if steps else ""))
    machine = median_machine(machines)
    rows = median_rounds([r["rows"] for r in rounds])
    print(f"\nmedian over {args.repeats} round(s): {format_machine(machine)}")
    print(format_roofline_table(rows))
    if engine is not None and engine.runner.graph_runner is not None:
        _graph_floors(engine, rows, args.context_len)
    _write_json(_result_path(args, "roofline"), {
        "host": describe_host(), "machine": machine.to_json(), "model": shape.__dict__, "dtype": dtype,
        "activation_quantization": args.activation_quantization, "rows": rows,
        "rounds": rounds,
    })
    return 0


def _graph_floors(engine: Any, rows: list[dict[str, Any]], context_len: int) -> None:
    """Each row's CUDA-graph launch floor (bench/graph_floor.py) beside its measured step (every
    row has one: the engine timed each batch size)."""
    from backfill.bench.graph_floor import measure_graph_floor

    print("\nCUDA graph launch floor (a graph of as many one-element kernels as the step launches):")
    for row in rows:
        floor = measure_graph_floor(engine.runner.graph_runner, row["batch_size"], context_len)
        if floor is None:
            print(f"- batch {row['batch_size']}: runs without a graph")
            continue
        floor["measured_over_floor"] = row["measured_ms"] / floor["floor_ms"]
        row["graph"] = floor
        print(f"- batch {row['batch_size']}: {floor['kernels']} kernels, floor {floor['floor_ms']:.3f} ms, "
              f"the step's graph replays in {floor['replay_ms']:.3f} ms, the engine's step "
              f"{row['measured_ms']:.3f} ms ({floor['measured_over_floor']:.2f}x the floor)")


def _cmd_structured(args: argparse.Namespace) -> int:
    from backfill.bench.offline import make_engine
    from backfill.bench.roofline import describe_host
    from backfill.bench.structured import format_structured, run_structured_bench

    _set_threads(args)
    if not 0 < args.fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {args.fraction}")
    engine = make_engine(EngineConfig.from_cli_args(args, max_num_seqs=args.batch_size))
    result = run_structured_bench(engine, args.batch_size, args.max_tokens, args.fraction, args.repeats)
    print(format_structured(result))
    _write_json(_result_path(args, "structured"), {"host": describe_host(), **result})
    return 0


def _cmd_divergence(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from backfill.bench.divergence import format_divergence, measure_divergence
    from backfill.bench.roofline import describe_host

    _set_threads(args)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be at least 1")
    if not 1 <= args.prompt_words[0] <= args.prompt_words[1]:
        raise ValueError(f"--prompt-words: need 1 <= MIN <= MAX, got {args.prompt_words}")
    result = measure_divergence(EngineConfig.from_cli_args(args), args.num_prompts, args.max_tokens, args.seed,
                                tuple(args.prompt_words), args.variant)
    print(format_divergence(result))
    _write_json(_result_path(args, "divergence"), {"host": describe_host(), **asdict(result)})
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Run the `bench` sub-command chosen in `args`; returns the process exit code."""
    handlers = {
        "workload": _cmd_workload, "serve": _cmd_serve, "offline": _cmd_offline,
        "compare": _cmd_compare, "roofline": _cmd_roofline, "structured": _cmd_structured,
        "divergence": _cmd_divergence,
    }
    try:
        if getattr(args, "plot", False):
            require_matplotlib()  # before the run, not after it
        return handlers[args.bench_command](args)
    except (ValueError, FileNotFoundError, MissingExtraError) as error:
        print(f"backfill bench {args.bench_command}: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backfill.bench.cli")
    parser.add_argument("--log-level", default="WARNING")
    add_bench_subparser(parser.add_subparsers(dest="command", required=True))
    # `python -m backfill.bench.cli serve ...` and `... bench serve ...` both work
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench"] + argv
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
