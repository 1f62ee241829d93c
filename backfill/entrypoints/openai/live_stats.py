"""LiveStats: what `GET /v1/stats` reports and `GET /dashboard` draws, kept from the engine's steps.

The core already sends every step's `StepStats` (slot states included) to the front end, so
nothing new crosses the process boundary: this observer appends one short record per step to
ring buffers on the event loop (a few microseconds a step) and does the arithmetic only when a
client polls. Windows:

```
timeline   the last TIMELINE_STEPS steps, one string a step, one letter a slot:
           u useful (advanced), i idle (held, did nothing), e empty (no request)
rates      the last RATE_WINDOW_S seconds: output tokens/s, slot shares, prefix-cache hit rate, cost
latencies  TTFT and TPOT of the requests that got a first token / finished in the last
           LATENCY_WINDOW_S seconds (at most MAX_LATENCY_SAMPLES each)
```

Cost: the machine is billed by the hour whatever its slots do, so the rate window's price over
the output tokens it produced is the cost per 1M output tokens (`bench/economics.py`), and the
slot-seconds no request advanced in (idle, empty; a core with nothing to do counts as all empty)
are the share of that money spent on nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from backfill.bench.economics import unit_economics
from backfill.core.outputs import StepStats
from backfill.engine.messages import CoreLoad
from backfill.outputs import RequestOutput

TIMELINE_STEPS = 300
RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0
MAX_LATENCY_SAMPLES = 10_000
PERCENTILES = (50, 90, 99)
SLOT_CODES = {"useful": "u", "idle": "i", "empty": "e"}
PAGE_PATH = Path(__file__).with_name("static") / "dashboard.html"


class _StepRecord(NamedTuple):
    """One message from the core, as the rate window needs it."""

    time: float  # when it arrived here (time.monotonic())
    duration: float  # of its step; 0: no step ran (the core only applied inputs)
    num_useful: int  # slots
    num_idle: int
    num_output_tokens: int
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int


class LiveStats:
    """Implements the AsyncEngine's `EngineObserver`; `snapshot()` is the /v1/stats body.

    Its totals count what `ServerMetrics` counts, from the same outputs: output tokens are
    `generation_tokens`, finished sequences `request_success` (every reason) plus `request_timeout`.
    """

    def __init__(self, model_name: str, num_slots: int, price_per_hour: float | None = None) -> None:
        if price_per_hour is not None and price_per_hour < 0:
            raise ValueError(f"price_per_hour: must be >= 0, got {price_per_hour}")
        self.model_name = model_name
        self.num_slots = num_slots
        self.price_per_hour = price_per_hour
        self.start_time = time.monotonic()
        # (step, slot letters)
        self._timeline: deque[tuple[int, str]] = deque(maxlen=TIMELINE_STEPS)
        self._window: deque[_StepRecord] = deque()
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_SAMPLES)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_SAMPLES)
        self._first_token_seen: set[str] = set()  # requests in flight whose TTFT is recorded
        self.num_steps = 0
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.num_requests_finished = 0
        self.num_requests_aborted = 0

    # ---- EngineObserver ------------------------------------------------------------------

    def on_step(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        now = time.monotonic()
        num_tokens = 0
        for output in outputs:
            num_tokens += self._observe_output(output, now)
        self.num_output_tokens += num_tokens
        if stats is None:
            self._window.append(_StepRecord(now, 0.0, 0, 0, num_tokens, 0, 0))
        else:
            self.num_steps += 1
            self._timeline.append((stats.step, "".join(SLOT_CODES.get(state, "e") for state in stats.slot_states)))
            self._window.append(_StepRecord(now, stats.duration, stats.num_slots_useful, stats.num_slots_idle,
                                            num_tokens, stats.num_prefix_cache_queries, stats.num_prefix_cache_hits))
        horizon = now - RATE_WINDOW_S
        while self._window and self._window[0].time < horizon:
            self._window.popleft()

    def _observe_output(self, output: RequestOutput, now: float) -> int:
        """Record the output's latencies; the number of new tokens it carries."""
        metrics = output.metrics
        if metrics.first_token_time is not None and output.request_id not in self._first_token_seen:
            self._first_token_seen.add(output.request_id)
            self.num_prompt_tokens += len(output.prompt_token_ids)
            self._ttft.append((now, max(metrics.first_token_time - metrics.arrival_time, 0.0)))
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.num_requests_finished += 1
        if output.finished:
            self._first_token_seen.discard(output.request_id)
            num_generated = max((len(completion.token_ids) for completion in output.outputs), default=0)
            if num_generated > 1 and metrics.first_token_time is not None and metrics.last_token_time is not None:
                self._tpot.append((now, (metrics.last_token_time - metrics.first_token_time) / (num_generated - 1)))
        return sum(len(completion.delta_token_ids) for completion in output.outputs)

    def on_abort(self, request_ids: list[str]) -> None:
        self.num_requests_aborted += len(request_ids)
        for request_id in request_ids:
            self._first_token_seen.discard(request_id)

    # ---- the feed ------------------------------------------------------------------------

    def snapshot(self, load: CoreLoad, num_waiting: int, since_step: int = -1) -> dict[str, Any]:
        """The /v1/stats body. `since_step`: the last timeline step the client has; only newer
        steps are sent (all the buffer holds by default; `first_step` says where they start, so
        a client that fell behind the buffer sees the gap)."""
        now = time.monotonic()
        window_s = max(min(RATE_WINDOW_S, now - self.start_time), 1e-3)
        horizon = now - window_s
        records = [record for record in self._window if record.time >= horizon]
        # Slot-seconds, of the window's num_slots x window_s: a step's slots last its duration.
        capacity_s = self.num_slots * window_s
        useful_share = min(sum(r.duration * r.num_useful for r in records) / capacity_s, 1.0)
        idle_share = min(sum(r.duration * r.num_idle for r in records) / capacity_s, 1.0 - useful_share)
        empty_share = 1.0 - useful_share - idle_share
        num_tokens = sum(r.num_output_tokens for r in records)
        queries = sum(r.num_prefix_cache_queries for r in records)
        hits = sum(r.num_prefix_cache_hits for r in records)
        timeline = [(step, states) for step, states in self._timeline if step > since_step]
        return {
            "model": self.model_name,
            "uptime_s": now - self.start_time,
            "num_slots": self.num_slots,
            "num_steps": self.num_steps,
            "requests": {"running": load.num_running, "waiting": num_waiting,
                         "finished": self.num_requests_finished, "aborted": self.num_requests_aborted},
            "kv_cache": {"usage": load.kv_usage, "blocks_used": load.num_kv_blocks_used,
                         "blocks_total": load.num_kv_blocks_total},
            "tokens": {"output_total": self.num_output_tokens, "prompt_total": self.num_prompt_tokens},
            "rate_window_s": window_s,
            "output_tokens_per_s": num_tokens / window_s,
            "slot_shares": {"useful": useful_share, "idle": idle_share, "empty": empty_share},
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None},
            "latency_window_s": LATENCY_WINDOW_S,
            "ttft_ms": _percentiles(self._ttft, now - LATENCY_WINDOW_S),
            "tpot_ms": _percentiles(self._tpot, now - LATENCY_WINDOW_S),
            "cost": self._cost(window_s, num_tokens, idle_share, empty_share),
            "timeline": {"first_step": timeline[0][0] if timeline else None,
                         "last_step": self._timeline[-1][0] if self._timeline else since_step,
                         "max_steps": TIMELINE_STEPS, "states": [states for _, states in timeline]},
        }

    def _cost(self, window_s: float, num_tokens: int, idle_share: float, empty_share: float) -> dict[str, Any] | None:
        """Cost per 1M output tokens at the window's throughput, and the idle and empty slots'
        parts of it; None without a price, per-token figures None with no tokens."""
        if self.price_per_hour is None:
            return None
        econ = unit_economics(self.price_per_hour, window_s, num_tokens, idle_share + empty_share, "slot-seconds")
        per_million = econ["cost_per_million_output_tokens"]
        if not math.isfinite(per_million):
            per_million = None
        return {
            "price_per_hour": self.price_per_hour,
            "per_million_output_tokens": per_million,
            "idle_share": idle_share,
            "empty_share": empty_share,
            "idle_per_million": None if per_million is None else per_million * idle_share,
            "empty_per_million": None if per_million is None else per_million * empty_share,
        }


def _percentiles(samples: deque[tuple[float, float]], horizon: float) -> dict[str, Any]:
    """p50/p90/p99 in ms of the samples recorded since `horizon` (linear interpolation, as in
    `bench`), and how many there were; None values when there were none."""
    while samples and samples[0][0] < horizon:
        samples.popleft()
    values = [value for _, value in samples]
    if not values:
        return {"count": 0, **{f"p{p}": None for p in PERCENTILES}}
    points = np.percentile(values, PERCENTILES) * 1000.0
    return {"count": len(values), **{f"p{p}": float(point) for p, point in zip(PERCENTILES, points)}}


def dashboard_page() -> bytes:
    """The page (HTML, CSS and script in one file: it loads nothing else)."""
    return PAGE_PATH.read_bytes()
