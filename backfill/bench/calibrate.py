"""`backfill plan calibrate`: measure this machine's steps and fit the planner's time model.

The real engine runs in this process over a fixed set of step shapes: prompts prefilled in
one step (up to the token budget), decode batches of 1 to 32 sequences at contexts of 16 to 768
tokens (the long ones from a shared prompt, so the prefix cache spares prefilling each copy),
and mixed steps (a prompt arriving mid-decode, chunked beside the decodes). Every step's shape
(cost_model.step_shape of what the scheduler scheduled) and wall time feed the fit.

`probe_server` then measures what a server adds: the front end's delay (single requests, their
TTFT against the simulated one) and the step slowdown when the HTTP process and the client
share the machine (concurrent batches of a few sizes, their TPOT against the simulated one).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from backfill.bench.cost_model import Calibration, StepShape, calibration_from_steps, step_shape
from backfill.config import EngineConfig
from backfill.core.outputs import SchedulerOutput

if TYPE_CHECKING:
    from backfill.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scenario:
    """`batch` sequences of `prompt_len` tokens each decoding `num_decode_steps` tokens. Shared:
    one prompt for all, the first prefilled alone, the others then hit the prefix cache. A
    prompt of `late_prompt_len` tokens joins after the second decode step: mixed steps."""

    batch: int
    prompt_len: int
    num_decode_steps: int
    shared: bool = False
    late_prompt_len: int = 96


# NOTE: decode steps are most of what a server runs, and one step's time varies by ~10% on a
# shared machine: each decode batch gets many steps, the fit follows their typical time.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(1, 16, 24), Scenario(2, 64, 24), Scenario(4, 128, 24), Scenario(8, 32, 24), Scenario(12, 48, 16),
    Scenario(16, 32, 16), Scenario(24, 24, 12), Scenario(32, 16, 12), Scenario(1, 512, 4), Scenario(4, 384, 4),
    Scenario(4, 768, 6, shared=True), Scenario(16, 512, 6, shared=True), Scenario(32, 256, 6, shared=True),
)
PROBE_REPEATS = 3  # batches of each size the server probe times
PROBE_BATCH_SIZES = (1, 4, 16)  # the server probe's batch sizes (its server's max_num_seqs at least the largest)
PROBE_TOKENS = 64  # output tokens of each probe request


def calibration_engine_config(config: EngineConfig, scenarios: Sequence[Scenario] = SCENARIOS) -> EngineConfig:
    """`config` with room for every scenario (by default 32 sequences of up to ~800 tokens)."""
    longest = max(s.prompt_len + s.num_decode_steps + s.late_prompt_len for s in scenarios)
    return replace(config, max_num_seqs=max(s.batch for s in scenarios) + 1,
                   max_model_len=max(config.max_model_len or 0, longest + 8), num_kv_blocks=None,
                   policy="continuous")


def run_calibration(config: EngineConfig, show_progress: bool = False,
                    scenarios: Sequence[Scenario] = SCENARIOS) -> Calibration:
    """Load the engine of `config` here, run `scenarios`, fit. SCENARIOS take a minute or two
    on 2 cores."""
    from backfill.bench.offline import make_engine, warm_up
    from backfill.bench.roofline import describe_host

    engine = make_engine(calibration_engine_config(config, scenarios))
    warm_up(engine)
    shapes: list[StepShape] = []
    seconds: list[float] = []
    overheads: list[float] = []
    started = time.monotonic()
    for number, scenario in enumerate(scenarios):
        s, t, o = _run_scenario(engine, scenario, tag=f"calib{number}")
        shapes += s
        seconds += t
        overheads += o
        if show_progress:
            print(f"calibration {number + 1}/{len(scenarios)}: {scenario} ({len(s)} steps)", flush=True)
    runner = engine.runner
    return calibration_from_steps(
        shapes, seconds, overheads,
        context_cost=runner.context_cost, max_position_embeddings=runner.model_config.max_position_embeddings,
        kv_bytes_per_token=runner.kv_bytes_per_token,
        description={"host": describe_host(), "model": engine.model_name, "dtype": str(runner.dtype),
                     "num_threads": config.num_threads, "seconds": round(time.monotonic() - started, 1)},
    )


def _prompt(seed: int, length: int) -> list[int]:
    return [(100 + 7 * seed + 13 * j) % 40000 + 10 for j in range(length)]


def _run_scenario(engine: LLMEngine, scenario: Scenario, tag: str
                  ) -> tuple[list[StepShape], list[float], list[float]]:
    """Run one scenario to the end; every step's shape, the core's time for it, and the time
    `LLMEngine.step()` spent after it (output processing)."""
    from backfill.bench.offline import greedy_params

    scheduler = engine.scheduler
    schedule = scheduler.schedule
    shapes: list[StepShape] = []
    seconds: list[float] = []
    overheads: list[float] = []

    def recording_schedule(now: float | None = None) -> SchedulerOutput:
        output = schedule(now)
        shapes.append(step_shape(output))
        return output

    def run_until(done: Callable[[], object]) -> None:
        while engine.has_unfinished_requests() and not done():
            start = time.monotonic()
            engine.step()
            wall = time.monotonic() - start
            if engine.last_step_stats is not None:
                seconds.append(engine.last_step_stats.duration)
                overheads.append(max(wall - engine.last_step_stats.duration, 0.0))

    params = greedy_params(scenario.num_decode_steps + 1)
    scheduler.schedule = recording_schedule  # type: ignore[method-assign]  # NOTE: this instance only
    try:
        first = 0
        if scenario.shared:  # the prompt's blocks computed once, the others reuse them
            engine.add_request(f"{tag}-0", _prompt(0, scenario.prompt_len), params)
            run_until(lambda: scheduler.running and scheduler.running[0].num_output_tokens > 0)
            first = 1
        for i in range(first, scenario.batch):
            engine.add_request(f"{tag}-{i}", _prompt(0 if scenario.shared else i, scenario.prompt_len), params)
        num_steps = len(seconds)
        run_until(lambda: len(seconds) >= num_steps + 3)
        engine.add_request(f"{tag}-late", _prompt(999, scenario.late_prompt_len), greedy_params(2))
        run_until(lambda: False)
    finally:
        del scheduler.schedule
    assert len(shapes) == len(seconds)
    # Empty steps (nothing scheduled) are not model steps
    kept = [i for i, s in enumerate(shapes) if s.num_tokens]
    return [shapes[i] for i in kept], [seconds[i] for i in kept], [overheads[i] for i in kept]


def probe_server(base_url: str, calibration: Calibration, config: EngineConfig,
                 batch_sizes: Sequence[int] = PROBE_BATCH_SIZES) -> Calibration:
    """Measure a running server's front-end delay and step slowdown against `calibration`;
    returns it with `frontend_s` and `served_step_factor` set. `config`: the server's engine
    settings (its max_model_len sizes the simulated KV pool); `batch_sizes`: the concurrent
    batches whose decode steps are timed, each at most the server's max_num_seqs.

    The slowdown is the median, over the batch sizes, of measured TPOT / simulated TPOT: the
    HTTP process and the client take CPU from the engine at every batch size, so one batch
    size (or one batch, on a shared machine) would set every prediction's speed on its own."""
    from backfill.bench.serve_client import ServeBenchConfig, run_serve_benchmark
    from backfill.bench.simulator import SimRequest, simulate
    from backfill.bench.workloads import WorkloadRequest

    bench = ServeBenchConfig(base_url=base_url, show_progress=False)
    # 1. Single requests, one at a time: TTFT = front end + one prefill step.
    singles = [WorkloadRequest(max_tokens=1, prompt_token_ids=_prompt(500 + i, 32), arrival_time=0.6 * i)
               for i in range(6)]

    def batch(size: int, max_tokens: int = PROBE_TOKENS) -> list[WorkloadRequest]:
        """`size` requests at once (their prompts new to the server's prefix cache)."""
        return [WorkloadRequest(max_tokens=max_tokens, prompt_token_ids=_prompt(600 + 37 * size + i, 32),
                                arrival_time=0.0) for i in range(size)]

    def measure(requests: list[WorkloadRequest]) -> dict[str, Any]:
        measured = run_serve_benchmark(requests, bench)
        if measured["failed"]:
            raise RuntimeError(f"the server probe failed: {measured['errors']}")
        return measured

    def sim(requests: list[WorkloadRequest], model: Calibration) -> dict[str, Any]:
        sim_requests = [SimRequest(list(r.prompt_token_ids or []), r.max_tokens, r.arrival_s) for r in requests]
        return simulate(sim_requests, config, model).summary()

    base = calibration.with_server(frontend_s=0.0, served_step_factor=1.0)
    tpots: dict[int, list[float]] = {}
    ratios = []
    for size in batch_sizes:
        # Warm-up: the server's first steps at each batch shape pay one-time costs (as warm_up here)
        run_serve_benchmark(batch(size, 8), bench)
        # NOTE: the median of PROBE_REPEATS batches: a few seconds each, so one burst of a
        # neighbour's work does not set the factor.
        tpots[size] = [measure(batch(size))["median_tpot_ms"] for _ in range(PROBE_REPEATS)]
        ratios.append(statistics.median(tpots[size]) / max(sim(batch(size), base)["median_tpot_ms"], 1e-9))
    factor = statistics.median(ratios)
    scaled = base.with_server(0.0, factor)
    measured_singles = measure(singles)
    frontend_s = statistics.median(  # ttfts are seconds
        m - s for m, s in zip(measured_singles["ttfts"], sim(singles, scaled)["ttfts"]))
    probed = scaled.with_server(max(frontend_s, 0.0), factor)
    description = {**calibration.description, "probe": {
        "base_url": base_url, "single_ttft_ms": 1000 * statistics.median(measured_singles["ttfts"]),
        "batch_median_tpot_ms": {str(size): t for size, t in tpots.items()},
        "tpot_ratios": dict(zip(map(str, batch_sizes), ratios))}}
    return replace(probed, description=description)
