"""Discrete-event simulation of serving a workload: the real `Scheduler`, steps timed by a model.

Each simulated engine drives its `Scheduler` exactly as `EngineCore.step()` does: schedule,
"run the model", `update_from_output`. The model run is replaced by the calibrated step time
(cost_model.py) and every sequence that samples gets one token (requests ignore EOS, as
`bench serve` sends them, so a request's output length is its `max_tokens`). The clock only
jumps: a step that starts at t ends at t + step_time(shape), and its tokens are stamped then.

Order of events, as in the engine core's loop: requests that arrived by the time a step
starts are added before its `schedule()`; a request arriving during a step waits for the next.
Arrivals are delayed by the front end's `frontend_s` (HTTP, tokenizing) before the core sees
them; TTFT counts from the client's send, as `bench serve` measures it.

Replicas are separate machines, each with its own engine at the calibrated speed (cost: N
times the price); a router sends each arrival to the engine with the fewest unfinished
requests (ties: the lowest index), or round-robin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from backfill.bench.cost_model import Calibration, step_shape
from backfill.bench.metrics import RequestResult, result_from_token_times, summarize
from backfill.config import EngineConfig
from backfill.core.outputs import ModelRunnerOutput
from backfill.core.scheduler import SLOT_USEFUL, Scheduler
from backfill.request import Request
from backfill.sampling_params import SamplingParams

Routing = Literal["least-loaded", "round-robin"]
ROUTINGS: tuple[str, ...] = ("least-loaded", "round-robin")
# The token every simulated sample returns: any id does (requests ignore EOS, no stop ids).
SAMPLED_TOKEN_ID = 1
# A run is cut off (as failed) past this many steps per engine: a scheduler that stops progressing
# must not hang the planner.
MAX_STEPS_PER_REQUEST_TOKEN = 4


@dataclass(frozen=True)
class SimRequest:
    """One request as the engine sees it: its prompt ids, output length and client send time."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float


@dataclass
class SimRun:
    """What a simulation measured: per-request results (as `bench serve` would record them) and
    slot accounting over the run."""

    results: list[RequestResult]
    duration: float
    num_steps: int
    busy_s: float  # summed over engines: seconds spent in steps
    slot_seconds: float  # summed over engines: max_num_seqs x duration
    useful_slot_seconds: float  # slot-seconds whose request advanced in the step
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, percentiles: Sequence[float] = (50.0, 99.0)) -> dict[str, Any]:
        """`metrics.summarize`'s fields plus the slot figures."""
        summary = summarize(self.results, self.duration, percentiles=percentiles)
        summary.update(num_steps=self.num_steps, busy_share=self.busy_s / max(self.duration, 1e-12),
                       slot_utilization=self.useful_slot_seconds / self.slot_seconds if self.slot_seconds else 0.0)
        return summary


class SimulatedEngine:
    """One engine core: the real Scheduler of `config`, its steps timed by `calibration`."""

    def __init__(self, config: EngineConfig, calibration: Calibration, served: bool, eos_token_id: int) -> None:
        self.config = config
        self.calibration = calibration
        self.served = served
        self.eos_token_id = eos_token_id
        self.scheduler = Scheduler(config, calibration.num_kv_blocks(config), config.resolved_prefill_budget(),
                                   calibration.context_cost)
        self.max_model_len = config.max_model_len or calibration.max_position_embeddings
        self.free_at = 0.0  # when the current step ends (the next may start)
        self.num_steps = 0
        self.busy_s = 0.0
        self.useful_slot_seconds = 0.0
        self.token_times: dict[str, list[float]] = {}

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    def add(self, request_id: str, request: SimRequest, now: float) -> str | None:
        """Queue `request` arriving at `now`; returns an error (as the server's 400) or None."""
        if len(request.prompt_token_ids) + request.max_tokens > self.max_model_len:
            return (f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_tokens}) "
                    f"exceeds max_model_len {self.max_model_len}")
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        idle = self.num_unfinished == 0
        try:
            self.scheduler.add_request(Request(
                request_id=request_id, prompt_token_ids=list(request.prompt_token_ids), params=params,
                eos_token_ids=(self.eos_token_id,), max_model_len=self.max_model_len, arrival_time=now))
        except ValueError as error:
            return str(error)
        if idle:
            self.free_at = max(self.free_at, now)  # an idle core wakes on the input
        self.token_times[request_id] = []
        return None

    def warm_up(self, requests: Sequence[SimRequest]) -> None:
        """Run `requests` to the end, then start the clock and the counters afresh."""
        for number, request in enumerate(requests):
            error = self.add(f"warmup-{number}", request, 0.0)
            if error is not None:
                raise ValueError(f"the warm-up request: {error}")
        while self.num_unfinished:
            self.step()
        self.free_at = self.busy_s = self.useful_slot_seconds = 0.0
        self.num_steps = 0
        self.token_times.clear()

    def step(self) -> list[str]:
        """Run one step starting at `free_at`; returns the ids of requests it finished."""
        start = self.free_at
        output = self.scheduler.schedule(now=start)
        duration = self.calibration.step_time(step_shape(output), self.served) if output.scheduled else 0.0
        end = start + duration
        sampling = [s.request_id for s in output.scheduled if s.sample]
        runner_output = ModelRunnerOutput(request_ids=sampling, sampled_token_ids=[SAMPLED_TOKEN_ID] * len(sampling))
        changed = self.scheduler.update_from_output(output, runner_output, end)
        useful = self.scheduler.last_slots()[1].count(SLOT_USEFUL)
        self.useful_slot_seconds += useful * duration
        self.busy_s += duration
        self.num_steps += 1
        self.free_at = end
        finished = []
        for request in changed:
            self.token_times[request.request_id].append(end)
            if request.finish_reason is not None:
                finished.append(request.request_id)
        return finished


def simulate(
    requests: Sequence[SimRequest],
    config: EngineConfig,
    calibration: Calibration,
    num_replicas: int = 1,
    routing: Routing = "least-loaded",
    served: bool = True,
    eos_token_id: int = 0,
    warmup: Sequence[SimRequest] = (),
) -> SimRun:
    """Serve `requests` on `num_replicas` simulated engines of `config`; returns when all finish.

    `served=False` simulates the engine in-process (`bench offline` / `bench compare`): no front
    end, step times unscaled. `warmup` requests run on the first engine before the clock starts,
    unmeasured (as `bench serve`'s warm-up request: its prompt stays in the prefix cache).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas: must be >= 1, got {num_replicas}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: must be one of {ROUTINGS}, got {routing!r}")
    if not requests:
        raise ValueError("requests: the workload is empty")
    engines = [SimulatedEngine(config, calibration, served, eos_token_id) for _ in range(num_replicas)]
    engines[0].warm_up(warmup)
    delay = calibration.frontend_s if served else 0.0
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    results: list[RequestResult | None] = [None] * len(requests)
    index_of: dict[str, int] = {}  # request_id -> its index in `requests`, until it finishes
    max_steps = MAX_STEPS_PER_REQUEST_TOKEN * sum(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 100
    position = 0
    while True:
        busy = [(e.free_at, i) for i, e in enumerate(engines) if e.num_unfinished]
        next_step = min(busy) if busy else (math.inf, -1)
        next_arrival = requests[order[position]].arrival_s + delay if position < len(order) else math.inf
        if next_arrival == math.inf and next_step[0] == math.inf:
            break
        if next_arrival <= next_step[0]:  # arrivals first: an input present when a step starts joins it
            index = order[position]
            target = engines[position % num_replicas] if routing == "round-robin" else min(
                engines, key=lambda e: e.num_unfinished)
            position += 1
            request_id = f"r{index}"
            error = target.add(request_id, requests[index], next_arrival)
            if error is not None:
                results[index] = RequestResult(success=False, expected_output_len=requests[index].max_tokens,
                                               start_time=requests[index].arrival_s, error=error)
            else:
                index_of[request_id] = index
            continue
        engine = engines[next_step[1]]
        if engine.num_steps >= max_steps:
            raise RuntimeError(f"the simulated scheduler made no progress in {max_steps} steps")
        for request_id in engine.step():
            index = index_of.pop(request_id)
            request = requests[index]
            times = engine.token_times.pop(request_id)
            results[index] = result_from_token_times(request.arrival_s, times, len(times), request.max_tokens,
                                                     prompt_len=len(request.prompt_token_ids))
    assert not index_of and all(r is not None for r in results), "a simulated request never finished"
    done = [r for r in results if r is not None]
    end = max((r.end_time for r in done if r.success), default=0.0)
    start = min(r.arrival_s for r in requests)
    duration = max(end - start, 1e-9)
    return SimRun(
        results=done, duration=duration, num_steps=sum(e.num_steps for e in engines),
        busy_s=sum(e.busy_s for e in engines), slot_seconds=num_replicas * config.max_num_seqs * duration,
        useful_slot_seconds=sum(e.useful_slot_seconds for e in engines),
    )
