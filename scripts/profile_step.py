"""Where a decode step's time goes: `num_steps` decode steps of `batch` sequences at ~`context`
tokens under torch.profiler, for the engine as configured (CUDA graphs, or `--enforce-eager`).
With `--admit`, mixed steps instead (continuous batching's admissions).
Prints the top ops by host (self CPU) time and, on CUDA, the top kernels by device time, with
how many of each one step launches; writes the same as JSON. Usage:

    python scripts/profile_step.py [--device cuda] [--dtype bfloat16] [--enforce-eager]
        [--model PATH] [--batch 32] [--context 128] [--steps 10] [--admit] [--result-file F]

(The GPU session's first question: on the H200 an eager step of the default model took ~25 ms
for ~800 kernels, ~30 us of host time each; this says which ops those are.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from backfill.bench.offline import greedy_params, make_engine, warm_up
from backfill.bench.workloads import distinct_prompt_ids
from backfill.config import EngineConfig


def decode_steps_under_profiler(engine, batch: int, context: int, num_steps: int, activities,
                                admit: bool = False) -> tuple[profile, list[float]]:
    """Admit `batch` prompts of `context` tokens, step until every one decodes, then profile
    `num_steps` decode-only steps, or with `admit` mixed steps (before each, the oldest
    sequence is aborted and a new prompt of `context` tokens added: batch - 1 decodes beside a
    whole prompt); returns (the profile, the wall times of the steps of the planned kind, s)."""
    tag = time.monotonic_ns()
    ids = [f"profile-{tag}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, distinct_prompt_ids(i, context), greedy_params(num_steps + 64))
    for _ in range(1000):  # the prompts' steps
        engine.step()
        stats = engine.last_step_stats
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch:
            break
    profiled, durations = 0, []
    with profile(activities=activities) as prof:
        for step in range(num_steps):
            if admit:  # continuous batching's admission: one sequence leaves, a new prompt comes
                engine.abort_request([ids[step]])
                ids.append(f"profile-{tag}-{batch + step}")
                engine.add_request(ids[-1], distinct_prompt_ids(batch + step, context), greedy_params(num_steps + 64))
            engine.step()
            stats = engine.last_step_stats
            if admit:  # (the prompt may come in chunks, per the engine's prefill budget)
                planned = stats is not None and stats.num_prefill_tokens > 0
            else:
                planned = stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch
            if planned:
                profiled += 1
                durations.append(stats.duration)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return prof, durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--admit", action="store_true",
                        help="mixed steps: each step one sequence leaves and a new prompt of --context tokens joins")
    parser.add_argument("--result-file", default=None)
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    config = EngineConfig.from_cli_args(args, max_num_seqs=max(args.batch, 1),
                                        max_model_len=args.context + args.steps + 128)
    engine = make_engine(config)
    warm_up(engine)
    on_cuda = config.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    prof, durations = decode_steps_under_profiler(engine, args.batch, args.context, args.steps, activities, args.admit)
    profiled = len(durations)
    averages = prof.key_averages()
    steps = max(profiled, 1)
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    summary: dict = {"device": config.device, "enforce_eager": config.enforce_eager, "admit": args.admit,
                     "batch": args.batch,
                     "context": args.context, "steps": profiled,
                     "step_ms": sorted(d * 1000 for d in durations),  # under the profiler: slower than bare
                     "graphs": engine.runner.graph_runner is not None,
                     "host_ops": [{"name": e.key, "calls_per_step": e.count / steps,
                                   "self_cpu_us_per_step": e.self_cpu_time_total / steps} for e in host]}
    kind = "decode steps"
    if args.admit:
        kind = f"mixed steps (a {args.context}-token prompt beside {args.batch - 1} decodes)"
    print(f"{profiled} {kind} of {args.batch} sequences at ~{args.context} tokens "
          f"({config.device}, {'CUDA graphs' if summary['graphs'] else 'eager'}), "
          f"{statistics.median(summary['step_ms']) if durations else float('nan'):.2f} ms a step (median, profiled)")
    if not host:
        print("(no torch op ran on the host: the CPU kernels' decode steps call none)")
    print("host: self CPU time per step")
    for row in summary["host_ops"]:
        print(f"  {row['self_cpu_us_per_step']:9.1f} us  {row['calls_per_step']:7.1f} calls  {row['name']}")
    if on_cuda:
        device_ops = [e for e in averages if getattr(e, "self_device_time_total", 0) > 0]
        device_ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
        summary["device_ops"] = [{"name": e.key, "calls_per_step": e.count / steps,
                                  "device_us_per_step": e.self_device_time_total / steps}
                                 for e in device_ops[: args.top]]
        total = sum(e.self_device_time_total for e in device_ops) / steps
        summary["device_us_per_step"] = total
        print(f"device: {total:.1f} us of kernels per step; the top ones")
        for row in summary["device_ops"]:
            print(f"  {row['device_us_per_step']:9.1f} us  {row['calls_per_step']:7.1f} calls  {row['name'][:90]}")
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
