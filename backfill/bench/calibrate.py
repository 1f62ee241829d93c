"""`backfill plan calibrate`: measure this machine's steps and fit the planner's time model.

The real engine runs in this process over a fixed set of step shapes: prompts prefilled in
one step (up to the token budget), decode batches of 1 to 32 sequences at contexts of 16 to 768
tokens (the long ones from a shared prompt, so the prefix cache spares prefilling each copy),
and mixed steps (a prompt arriving mid-decode, chunked beside the decodes). Every step's shape
(cost_model.step_shape of what the scheduler scheduled) and wall time feed the fit.

`probe_server` then measures what a server adds: the front end's delay (single requests, their
TTFT against the simulated one) and the step slowdown when the HTTP process and the client
share the machine (a burst of mixed requests, its duration against the simulated one).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from backfill.bench.cost_model import Calibration, StepShape, calibration_from_steps, step_shape
from backfill.bench.workloads import WorkloadRequest, distinct_prompt_ids
from backfill.config import EngineConfig
from backfill.core.outputs import SchedulerOutput

if TYPE_CHECKING:
    from backfill.bench.serve_client import ServeBenchConfig
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
PROBE_REPEATS = 3  # bursts the server probe times
PROBE_REQUESTS_PER_SLOT = 1.5  # a burst's requests per slot of the probed server: queueing, then a tail
PROBE_SLOTS = 16  # max_num_seqs of the server `plan check` starts for its probe


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
            engine.add_request(f"{tag}-0", distinct_prompt_ids(0, scenario.prompt_len), params)
            run_until(lambda: scheduler.running and scheduler.running[0].num_output_tokens > 0)
            first = 1
        for i in range(first, scenario.batch):
            prompt = distinct_prompt_ids(0 if scenario.shared else i, scenario.prompt_len)
            engine.add_request(f"{tag}-{i}", prompt, params)
        num_steps = len(seconds)
        run_until(lambda: len(seconds) >= num_steps + 3)
        engine.add_request(f"{tag}-late", distinct_prompt_ids(999, scenario.late_prompt_len), greedy_params(2))
        run_until(lambda: False)
    finally:
        del scheduler.schedule
    assert len(shapes) == len(seconds)
    # Empty steps (nothing scheduled) are not model steps
    kept = [i for i, s in enumerate(shapes) if s.num_tokens]
    return [shapes[i] for i in kept], [seconds[i] for i in kept], [overheads[i] for i in kept]


def probe_server(base_url: str, calibration: Calibration, config: EngineConfig,
                 num_slots: int | None = None, api_key: str | None = None) -> Calibration:
    """Measure a running server's front-end delay and step slowdown against `calibration`;
    returns it with `frontend_s` and `served_step_factor` set. `config`: the server's engine
    settings (its max_model_len sizes the simulated KV pool); `num_slots`: its max_num_seqs
    (default: asked of its /v1/stats).

    The slowdown is what a served run takes over the simulation of the same run: a burst of
    mixed requests (PROBE_REQUESTS_PER_SLOT per slot, short and long answers, prompts of
    varied length), so the probe's steps are the kinds a served workload runs: full batches
    and the tail's smaller ones, prompts prefilled beside decodes, contexts growing. The HTTP
    process and the client take CPU from the engine all along (on 2 cores, ~10-30% of its
    step time, measured): the factor charges that to every step. The median of PROBE_REPEATS
    bursts, each of new prompts (a replay would hit the prefix cache)."""
    from backfill.bench.planner import sim_requests
    from backfill.bench.serve_client import ServeBenchConfig, run_serve_benchmark
    from backfill.bench.simulator import simulate

    bench = ServeBenchConfig(base_url=base_url, show_progress=False, api_key=api_key)
    if num_slots is None:
        num_slots = _server_slots(bench)
    served_config = replace(config, max_num_seqs=num_slots)
    # 1. Single requests, one at a time: TTFT = front end + one prefill step.
    singles = [WorkloadRequest(max_tokens=1, prompt_token_ids=distinct_prompt_ids(500 + i, 32), arrival_time=0.6 * i)
               for i in range(6)]

    def measure(requests: list[WorkloadRequest]) -> dict[str, Any]:
        measured = run_serve_benchmark(requests, bench)
        if measured["failed"]:
            raise RuntimeError(f"the server probe failed: {measured['errors']}")
        return measured

    def sim(requests: list[WorkloadRequest], model: Calibration) -> dict[str, Any]:
        return simulate(sim_requests(requests, None), served_config, model).summary()  # prompts are token ids

    base = calibration.with_server(frontend_s=0.0, served_step_factor=1.0)
    # Warm-up: the server's first steps at each batch shape pay one-time costs (as warm_up here)
    run_serve_benchmark(_burst(num_slots, 0, max_tokens=8), bench)
    ratios, durations = [], []
    for repeat in range(PROBE_REPEATS):
        burst = _burst(num_slots, repeat + 1)
        measured = measure(burst)
        durations.append(measured["duration"])
        ratios.append(measured["duration"] / max(sim(burst, base)["duration"], 1e-9))
    factor = statistics.median(ratios)
    scaled = base.with_server(0.0, factor)
    measured_singles = measure(singles)
    frontend_s = statistics.median(  # ttfts are seconds
        m - s for m, s in zip(measured_singles["ttfts"], sim(singles, scaled)["ttfts"]))
    probed = scaled.with_server(max(frontend_s, 0.0), factor)
    description = {**calibration.description, "probe": {
        "base_url": base_url, "num_slots": num_slots, "single_ttft_ms": 1000 * statistics.median(measured_singles["ttfts"]),
        "burst_durations_s": durations, "burst_ratios": ratios}}
    return replace(probed, description=description)


def _burst(num_slots: int, seed: int, max_tokens: int | None = None) -> list[WorkloadRequest]:
    """PROBE_REQUESTS_PER_SLOT x `num_slots` requests at once: prompts of 16-192 tokens, half of
    them answered in 2-8 tokens and half in 32-160 (or all in `max_tokens`); new prompts per seed."""
    rng = random.Random(seed)
    requests = []
    for i in range(int(PROBE_REQUESTS_PER_SLOT * num_slots)):
        tokens = max_tokens or (rng.randint(2, 8) if i % 2 else rng.randint(32, 160))
        prompt = distinct_prompt_ids(1000 * seed + 7 * i + 3, rng.randint(16, 192))
        requests.append(WorkloadRequest(max_tokens=tokens, prompt_token_ids=prompt, arrival_time=0.0))
    return requests


def _server_slots(bench: ServeBenchConfig) -> int:
    """The server's max_num_seqs, from its /v1/stats."""
    import httpx

    from backfill.bench.serve_client import request_headers

    base_url = bench.base_url
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/stats", headers=request_headers(bench), timeout=10)
        response.raise_for_status()
        return int(response.json()["num_slots"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
        raise RuntimeError(f"could not read the server's number of slots from {base_url}/v1/stats ({error}); "
                           "give it (--probe-num-slots)") from error
