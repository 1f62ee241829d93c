"""LiveStats (the /v1/stats feed) from hand-written engine outputs: what each figure counts."""

from __future__ import annotations

import time

import pytest

from backfill.core.outputs import StepStats
from backfill.engine.messages import CoreLoad
from backfill.entrypoints.openai.live_stats import TIMELINE_STEPS, LiveStats
from backfill.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(request_id: str, token_ids: list[int], finish: str | None, first: float, last: float) -> RequestOutput:
    completion = CompletionOutput(index=0, token_ids=token_ids, finish_reason=finish, delta_token_ids=token_ids[-1:])
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=first, last_token_time=last)
    return RequestOutput(request_id, None, [1, 2, 3, 4], [completion], finish is not None, metrics)


def _stats(step: int, states: list[str], duration: float = 0.5) -> StepStats:
    useful, idle = states.count("useful"), states.count("idle")
    return StepStats(step=step, start_time=0.0, duration=duration, num_batched_tokens=useful, num_prefill_tokens=0,
                     num_decode_tokens=useful, num_running=useful + idle, num_waiting=0, num_kv_blocks_used=1,
                     num_kv_blocks_total=10, num_preempted=0, num_slots=len(states), num_slots_useful=useful,
                     num_slots_idle=idle, slot_states=states, num_prefix_cache_queries=8, num_prefix_cache_hits=2)


def test_totals_latencies_and_timeline() -> None:
    live = LiveStats("m", 4)
    live.start_time -= 100.0  # a full rate window has passed since the start
    states = ["useful", "idle", "empty", "empty"]
    live.on_step([_output("a", [7], None, first=0.25, last=0.25)], _stats(1, states))
    live.on_step([_output("a", [7, 8], None, first=0.25, last=0.5)], _stats(2, states))
    live.on_step([_output("a", [7, 8, 9], "length", first=0.25, last=1.25)], _stats(3, states))
    live.on_abort(["b"])
    body = live.snapshot(CoreLoad(num_running=1, num_kv_blocks_used=5, num_kv_blocks_total=10), num_waiting=2)
    assert body["tokens"] == {"output_total": 3, "prompt_total": 4}
    assert body["requests"] == {"running": 1, "waiting": 2, "finished": 1, "aborted": 1}
    assert body["kv_cache"] == {"usage": 0.5, "blocks_used": 5, "blocks_total": 10}
    assert body["num_steps"] == 3
    assert body["ttft_ms"] == {"count": 1, "p50": 250.0, "p90": 250.0, "p99": 250.0}
    assert body["tpot_ms"]["p50"] == pytest.approx(500.0)  # (1.25 - 0.25) s over 2 tokens after the first
    assert body["timeline"] == {"first_step": 1, "last_step": 3, "max_steps": TIMELINE_STEPS, "states": ["uiee"] * 3}
    # Three steps of 0.5 s in a 10 s window of 4 slots: 1.5 slot-seconds useful, 1.5 idle, the rest empty.
    assert body["rate_window_s"] == 10.0
    assert body["slot_shares"]["useful"] == pytest.approx(1.5 / 40)
    assert body["slot_shares"]["idle"] == pytest.approx(1.5 / 40)
    assert body["slot_shares"]["empty"] == pytest.approx(1 - 3 / 40)
    assert body["output_tokens_per_s"] == pytest.approx(0.3)
    assert body["prefix_cache"] == {"queries": 24, "hits": 6, "hit_rate": 0.25}
    assert body["cost"] is None  # no price
    # A client holding step 2 gets step 3 only.
    newer = live.snapshot(CoreLoad(), 0, since_step=2)["timeline"]
    assert newer["states"] == ["uiee"] and newer["first_step"] == 3
    assert live.snapshot(CoreLoad(), 0, since_step=3)["timeline"] == {
        "first_step": None, "last_step": 3, "max_steps": TIMELINE_STEPS, "states": []}


def test_cost_at_a_price() -> None:
    live = LiveStats("m", 2, price_per_hour=3.6)  # $0.001 a second
    live.start_time -= 100.0
    live.on_step([_output(f"r{i}", [5], None, first=1.0, last=1.0) for i in range(20)],
                 _stats(1, ["useful", "empty"], duration=10.0))
    cost = live.snapshot(CoreLoad(), 0)["cost"]
    # 10 s cost $0.01 and made 20 tokens: $500 per 1M; half the slot time was empty.
    assert cost["per_million_output_tokens"] == pytest.approx(500.0)
    assert cost["idle_share"] == 0.0 and cost["empty_share"] == pytest.approx(0.5)
    assert cost["idle_per_million"] == 0.0 and cost["empty_per_million"] == pytest.approx(250.0)


def test_an_idle_engine_has_no_cost_per_token_and_old_samples_leave() -> None:
    live = LiveStats("m", 2, price_per_hour=1.0)
    body = live.snapshot(CoreLoad(), 0)
    assert body["cost"]["per_million_output_tokens"] is None
    assert body["slot_shares"] == {"useful": 0.0, "idle": 0.0, "empty": 1.0}
    assert body["ttft_ms"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    live.on_step([_output("a", [7], None, first=0.5, last=0.5)], None)
    live._ttft[0] = (time.monotonic() - 61.0, 0.5)  # recorded past the latency window
    assert live.snapshot(CoreLoad(), 0)["ttft_ms"]["count"] == 0


def test_the_timeline_keeps_the_last_steps() -> None:
    live = LiveStats("m", 1)
    for step in range(1, TIMELINE_STEPS + 11):
        live.on_step([], _stats(step, ["useful" if step % 2 else "idle"], duration=0.0))
    timeline = live.snapshot(CoreLoad(), 0)["timeline"]
    assert len(timeline["states"]) == TIMELINE_STEPS and timeline["last_step"] == TIMELINE_STEPS + 10
    assert timeline["first_step"] == 11  # the oldest steps left the ring
    assert timeline["states"][-2:] == ["u", "i"]  # steps 309 and 310
    with pytest.raises(ValueError, match="price_per_hour"):
        LiveStats("m", 1, price_per_hour=-1.0)
