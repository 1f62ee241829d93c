"""Offline benchmark: the engine in-process, fed a workload at its arrival times.

Every step's `StepStats` is kept (the slot timeline and step-time figures come from them) and
each request's token events are timed when `step()` returns them, so the per-request figures
use the same definitions (metrics.py) as the HTTP client.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from tqdm import tqdm

from backfill.bench.economics import unit_economics
from backfill.bench.metrics import RequestResult, percentile, result_from_token_times, summarize
from backfill.bench.roofline import MachineRoofline, ModelShape, ideal_step
from backfill.bench.workloads import WorkloadRequest, distinct_prompt_ids
from backfill.core.outputs import StepStats
from backfill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backfill.config import EngineConfig
    from backfill.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 1024  # enough for the standard workloads; bounds the KV pool's memory


@dataclass
class OfflineRun:
    """One pass of a workload through one system: per-request results and per-step stats."""

    label: str
    results: list[RequestResult]
    step_stats: list[StepStats]
    duration: float
    extra: dict[str, Any] = field(default_factory=dict)


def make_engine(config: EngineConfig) -> LLMEngine:
    """The engine of `config`, loaded in this process (torch and the model load here)."""
    from backfill.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Exactly `max_tokens` tokens, greedy: lengths as asked, work identical across systems."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_up(engine: LLMEngine, num_requests: int | None = None, max_tokens: int = 4) -> None:
    """Tiny requests filling every slot, so the first measured steps pay no one-time costs
    (allocations and kernel choices for the full batch shape)."""
    for i in range(num_requests or engine.config.max_num_seqs):
        engine.add_request(f"warmup-{time.monotonic_ns()}-{i}", "Warm up the engine, please.", greedy_params(max_tokens))
    while engine.has_unfinished_requests():
        engine.step()


def run_offline_workload(
    engine: LLMEngine,
    requests: Sequence[WorkloadRequest],
    label: str,
    show_progress: bool = False,
) -> OfflineRun:
    """Replay `requests` through `engine` in real time; returns when every request finished.

    A request's clock starts at its scheduled arrival (start + arrival_time), so time it
    spends queued counts in its TTFT. A request the engine rejects is a failed result.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    prefix = f"{label}-{time.monotonic_ns()}"
    results: list[RequestResult | None] = [None] * len(requests)
    token_times: dict[int, list[float]] = {}
    num_tokens: dict[int, int] = {}
    index_of: dict[str, int] = {}
    steps: list[StepStats] = []
    progress = tqdm(total=len(requests), desc=label, disable=not show_progress)
    start = time.monotonic()
    position = 0
    while position < len(order) or engine.has_unfinished_requests():
        now = time.monotonic()
        while position < len(order) and start + requests[order[position]].arrival_s <= now:
            index = order[position]
            position += 1
            request = requests[index]
            arrival = start + request.arrival_s
            prompt: str | list[int] = request.prompt if request.prompt is not None else list(request.prompt_token_ids or [])
            request_id = f"{prefix}-{index}"
            try:
                engine.add_request(request_id, prompt, greedy_params(request.max_tokens), arrival_time=arrival)
            except ValueError as error:
                results[index] = RequestResult(success=False, expected_output_len=request.max_tokens,
                                               start_time=arrival, error=str(error))
                progress.update(1)
                continue
            index_of[request_id] = index
            token_times[index], num_tokens[index] = [], 0
        if not engine.has_unfinished_requests():
            if position < len(order):
                time.sleep(max(0.0, start + requests[order[position]].arrival_s - time.monotonic()))
            continue
        outputs = engine.step()
        stamp = time.monotonic()
        if engine.last_step_stats is not None:
            steps.append(engine.last_step_stats)
        for output in outputs:
            index = index_of[output.request_id]
            delta = sum(len(c.delta_token_ids) for c in output.outputs)
            if delta:
                token_times[index].append(stamp)
                num_tokens[index] += delta
            if output.finished:
                arrival = start + requests[index].arrival_s
                if token_times[index]:
                    results[index] = result_from_token_times(
                        arrival, token_times[index], num_tokens[index], requests[index].max_tokens,
                        prompt_len=len(output.prompt_token_ids), cached_len=output.num_cached_tokens,
                    )
                else:
                    results[index] = RequestResult(success=False, expected_output_len=requests[index].max_tokens,
                                                   start_time=arrival, error="finished without tokens")
                progress.update(1)
    duration = time.monotonic() - start
    progress.close()
    assert all(r is not None for r in results), "a request never finished"
    return OfflineRun(label, [r for r in results if r is not None], steps, duration)


def step_summary(steps: Sequence[StepStats]) -> dict[str, Any]:
    """Step-time statistics and how the slot-steps were spent (useful / idle / empty)."""
    durations = [s.duration for s in steps]
    slot_steps = sum(s.num_slots for s in steps)
    useful = sum(s.num_slots_useful for s in steps)
    idle = sum(s.num_slots_idle for s in steps)
    return {
        "num_steps": len(steps),
        "mean_step_ms": 1000 * sum(durations) / max(len(durations), 1),
        "median_step_ms": 1000 * percentile(durations, 50),
        "p99_step_ms": 1000 * percentile(durations, 99),
        "total_step_s": sum(durations),
        "mean_running": sum(s.num_running for s in steps) / max(len(steps), 1),
        "num_preemptions": sum(s.num_preempted for s in steps),
        "useful_slot_share": useful / slot_steps if slot_steps else 0.0,
        "idle_slot_share": idle / slot_steps if slot_steps else 0.0,
        "empty_slot_share": (slot_steps - useful - idle) / slot_steps if slot_steps else 0.0,
    }


def step_roofline(
    steps: Sequence[StepStats], model: ModelShape, machine: MachineRoofline, dtype: str, block_size: int
) -> dict[str, Any]:
    """How far the measured steps are from the roofline.

    Attention's KV read is bounded by the blocks in use (whole blocks, so slightly high).
    Decode-only steps are grouped by batch size: the median measured vs ideal step for each.
    """
    total_ideal = 0.0
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for s in steps:
        if s.num_batched_tokens == 0:
            continue
        ideal = ideal_step(model, machine, dtype, s.num_batched_tokens, max(s.num_slots_useful, 1),
                           s.num_kv_blocks_used * block_size)["ideal_s"]
        total_ideal += ideal
        if s.num_prefill_tokens == 0:
            by_batch.setdefault(s.num_decode_tokens, []).append((s.duration, ideal))
    total_measured = sum(s.duration for s in steps if s.num_batched_tokens)
    rows = []
    for batch in sorted(by_batch):
        measured = [m for m, _ in by_batch[batch]]
        ideals = [i for _, i in by_batch[batch]]
        rows.append({
            "batch_size": batch,
            "num_steps": len(measured),
            "median_measured_ms": 1000 * percentile(measured, 50),
            "median_ideal_ms": 1000 * percentile(ideals, 50),
            "measured_over_ideal": percentile(measured, 50) / max(percentile(ideals, 50), 1e-12),
        })
    return {
        "roofline_efficiency": total_ideal / total_measured if total_measured else 0.0,
        "decode_steps_by_batch": rows,
    }


def format_step_roofline(rows: Sequence[dict[str, Any]], min_steps: int = 5) -> str:
    """Markdown table of `step_roofline` decode rows with at least `min_steps` steps."""
    lines = ["| batch | decode steps | median measured (ms) | median ideal (ms) | measured / ideal |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["num_steps"] >= min_steps:
            lines.append(f"| {r['batch_size']} | {r['num_steps']} | {r['median_measured_ms']:.1f} | "
                         f"{r['median_ideal_ms']:.1f} | {r['measured_over_ideal']:.2f}x |")
    return "\n".join(lines)


def summarize_offline(
    run: OfflineRun,
    percentiles: Sequence[float] = (50.0, 99.0),
    roofline: tuple[ModelShape, MachineRoofline, str, int] | None = None,
    price_per_hour: float | None = None,
) -> dict[str, Any]:
    """vLLM-style figures + step statistics (+ roofline, + unit economics when asked)."""
    summary = summarize(run.results, run.duration, percentiles=percentiles)
    summary = {"label": run.label, **summary, **step_summary(run.step_stats), **run.extra}
    if roofline is not None:
        model, machine, dtype, block_size = roofline
        summary.update(step_roofline(run.step_stats, model, machine, dtype, block_size))
    if price_per_hour is not None:
        summary["economics"] = unit_economics(
            price_per_hour, run.duration, summary["total_output_tokens"],
            wasted_share=1.0 - summary["useful_slot_share"] if run.step_stats else None,
            wasted_share_source="engine step statistics",
        )
    return summary


def measure_decode_step(engine: LLMEngine, batch_size: int, prompt_len: int, num_steps: int) -> float:
    """Median wall time (s) of a decode step with exactly `batch_size` sequences at ~`prompt_len` context.

    Needs `engine.config.max_num_seqs >= batch_size`. Prompts are distinct token-id lists so
    no cache could share them. Each request may decode until the context is full, so the
    first ones admitted are still running when the last prompt is in; the requests are
    aborted once `num_steps` full decode steps were timed.
    """
    if engine.config.max_num_seqs < batch_size:
        raise ValueError(f"batch_size: {batch_size} exceeds the engine's max_num_seqs {engine.config.max_num_seqs}")
    max_len = engine.max_model_len
    if max_len <= prompt_len + num_steps:
        raise ValueError(f"prompt_len: {prompt_len} + {num_steps} steps does not fit max_model_len {max_len}")
    tag = time.monotonic_ns()
    request_ids = [f"roofline-{tag}-{i}" for i in range(batch_size)]
    for i, request_id in enumerate(request_ids):
        engine.add_request(request_id, distinct_prompt_ids(i, prompt_len), greedy_params(max_len - prompt_len))
    decode_times: list[float] = []
    while engine.has_unfinished_requests() and len(decode_times) < num_steps:
        engine.step()
        stats = engine.last_step_stats
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch_size:
            decode_times.append(stats.duration)
    engine.abort_request(request_ids)
    while engine.has_unfinished_requests():
        engine.step()
    if not decode_times:
        raise RuntimeError(f"no decode step ran all {batch_size} sequences together")
    return percentile(decode_times, 50)
