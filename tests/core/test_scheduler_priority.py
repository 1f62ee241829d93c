"""Scheduler: the priority policy (preemption for a better priority, aging) and deadlines."""

from __future__ import annotations

import random

import pytest

from backfill.core.outputs import SchedulerOutput
from backfill.core.scheduler import Scheduler
from backfill.request import FinishReason, RequestStatus
from tests.core.core_factories import (
    FakeRunner,
    assert_all_free,
    expected_output,
    make_request,
    make_scheduler,
    step,
)


def make_priority_scheduler(num_kv_blocks: int = 256, **overrides: object) -> Scheduler:
    return make_scheduler(num_kv_blocks, scheduling_policy="priority", **overrides)


def run_to_end(scheduler: Scheduler, runner: FakeRunner) -> None:
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_all_free(scheduler)


def test_a_better_priority_preempts_the_worst_running_request_for_a_slot() -> None:
    scheduler = make_priority_scheduler(max_num_seqs=2)
    runner = FakeRunner(256, 4)
    low = [make_request(f"low{i}", 4, 20, priority=10, arrival_time=float(i)) for i in range(3)]
    for request in low:
        scheduler.add_request(request)
    step(scheduler, runner)
    step(scheduler, runner)
    vip = make_request("vip", 4, 3, priority=0, arrival_time=10.0)
    scheduler.add_request(vip)
    out, changed = step(scheduler, runner)
    # The most recent running arrival goes; vip runs its prompt and samples in the same step.
    assert out.preempted_request_ids == ["low1"] and out.fair_share_preempted_ids == []
    assert [s.request_id for s in out.scheduled] == ["low0", "vip"]
    assert vip in changed and vip.num_output_tokens == 1
    # The victim keeps its place: before low2, which arrived after it.
    assert [r.request_id for r in scheduler.waiting] == ["low1", "low2"]
    assert low[1].priority == 10 and low[1].status == RequestStatus.PREEMPTED
    run_to_end(scheduler, runner)
    assert all(r.output_token_ids == expected_output(r) for r in [*low, vip])


def test_equal_or_worse_priorities_never_preempt() -> None:
    scheduler = make_priority_scheduler(max_num_seqs=2)
    runner = FakeRunner(256, 4)
    for i in range(2):
        scheduler.add_request(make_request(f"p0.{i}", 4, 10, priority=0, arrival_time=float(i)))
    step(scheduler, runner)
    scheduler.add_request(make_request("same", 4, 2, priority=0, arrival_time=5.0))
    scheduler.add_request(make_request("worse", 4, 2, priority=3, arrival_time=6.0))
    for _ in range(8):
        out, _ = step(scheduler, runner)
        assert out.preempted_request_ids == []
        assert {r.request_id for r in scheduler.running} == {"p0.0", "p0.1"}
    run_to_end(scheduler, runner)


def test_a_better_priority_preempts_for_kv_blocks() -> None:
    # 4 blocks of 4 tokens: two low requests of 8 tokens fill the pool; slots are free.
    scheduler = make_priority_scheduler(num_kv_blocks=4, max_num_seqs=4)
    runner = FakeRunner(4, 4)
    low = [make_request(f"low{i}", 7, 2, priority=5, arrival_time=float(i)) for i in range(2)]
    for request in low:
        scheduler.add_request(request)
    step(scheduler, runner)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    vip = make_request("vip", 4, 1, priority=-1, arrival_time=9.0)
    scheduler.add_request(vip)
    out, _ = step(scheduler, runner)
    assert out.preempted_request_ids == ["low1"]
    assert "vip" in [s.request_id for s in out.scheduled] and vip.is_finished
    run_to_end(scheduler, runner)
    assert all(r.output_token_ids == expected_output(r) for r in low)


def test_fcfs_never_preempts_for_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(256, 4)
    scheduler.add_request(make_request("first", 4, 5, priority=5))
    step(scheduler, runner)
    scheduler.add_request(make_request("vip", 4, 1, priority=-5, arrival_time=1.0))
    for _ in range(4):
        out, _ = step(scheduler, runner)
        assert out.preempted_request_ids == [] and [s.request_id for s in out.scheduled] == ["first"]
    run_to_end(scheduler, runner)


@pytest.mark.parametrize("aging_steps", [1, 5])
def test_aging_bounds_how_long_a_low_priority_waits(aging_steps: int) -> None:
    """One slot and a priority-0 arrival every step, each served in one step: without aging the
    priority-3 request would never run. With it, every request's effective priority falls by
    one per `aging_steps` steps since its arrival, so only the priority-0 requests arriving
    within about 3 * aging_steps steps after it overtake it (preempting it, too): it first runs
    within 3 * aging_steps + 2 steps, and ends soon after, later arrivals never being strictly
    better than it."""
    scheduler = make_priority_scheduler(max_num_seqs=1, priority_aging_steps=aging_steps)
    runner = FakeRunner(256, 4)
    low = make_request("low", 4, 6, priority=3, arrival_time=0.5)
    scheduler.add_request(make_request("p0.0", 4, 1, arrival_time=0.0))
    scheduler.add_request(low)
    num_steps = 0
    first_scheduled = None
    while not low.is_finished:
        out, _ = step(scheduler, runner, now=float(num_steps))
        num_steps += 1
        if first_scheduled is None and any(s.request_id == "low" for s in out.scheduled):
            first_scheduled = num_steps
        scheduler.add_request(make_request(f"p0.{num_steps}", 4, 1, arrival_time=float(num_steps)))
        assert num_steps < 1000
    assert first_scheduled is not None and first_scheduled <= 3 * aging_steps + 2
    assert num_steps <= 4 * aging_steps + 8 and low.output_token_ids == expected_output(low)
    run_to_end(scheduler, runner)


def test_a_waiting_request_past_its_deadline_never_reaches_the_model() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(256, 4)
    busy = make_request("busy", 4, 10, arrival_time=0.0)
    late = make_request("late", 4, 2, arrival_time=0.0)
    late.deadline = 3.0
    scheduler.add_request(busy)
    scheduler.add_request(late)
    outputs: list[SchedulerOutput] = []
    for now in range(5):
        outputs.append(step(scheduler, runner, now=float(now))[0])
    timed_out = [out for out in outputs if out.timed_out_request_ids]
    assert [out.timed_out_request_ids for out in timed_out] == [["late"]]
    assert outputs.index(timed_out[0]) == 3  # the first schedule() at or after the deadline
    assert "late" in timed_out[0].finished_request_ids
    assert all(s.request_id != "late" for out in outputs for s in out.scheduled)
    assert late.finish_reason == FinishReason.TIMEOUT and late.first_scheduled_time is None
    assert late.finish_time == 3.0 and scheduler.get_request("late") is None
    run_to_end(scheduler, runner)


def test_a_running_request_past_its_deadline_is_finished_at_the_next_schedule() -> None:
    scheduler = make_scheduler(max_num_seqs=1, block_size=4)
    runner = FakeRunner(256, 4)
    slow = make_request("slow", 6, 20, arrival_time=0.0)
    slow.deadline = 2.5
    queued = make_request("queued", 4, 2, arrival_time=1.0)
    scheduler.add_request(slow)
    scheduler.add_request(queued)
    for now in range(3):
        step(scheduler, runner, now=float(now))
    assert slow.status == RequestStatus.RUNNING and scheduler.kv_cache_manager.num_used_blocks > 0
    out, _ = step(scheduler, runner, now=3.0)
    assert out.timed_out_request_ids == ["slow"] and "slow" in out.finished_request_ids
    assert slow.finish_reason == FinishReason.TIMEOUT and slow.num_output_tokens == 3
    assert slow.output_token_ids == expected_output(slow)[:3]
    # Its slot and blocks went to the queued request in the same step.
    assert [s.request_id for s in out.scheduled] == ["queued"]
    run_to_end(scheduler, runner)


@pytest.mark.parametrize("seed", range(30))
def test_random_priority_workloads_with_deadlines(seed: int) -> None:
    """Random arrivals, priorities and deadlines under the priority policy on short pools:
    every request ends with the fake model's tokens (a prefix of them if it timed out), nothing
    is scheduled at or after its deadline, and the pool ends empty."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    arrivals = []
    arrival_step = 0
    for i in range(rng.randint(1, 24)):
        arrival_step += rng.choice([0, 0, 1, 3])
        priority = rng.choice([0, 0, 1, 5, -1])
        for k in range(rng.choice([1, 1, 2, 4])):
            request = make_request(f"r{i}.{k}", prompt_len=rng.randint(1, 20), max_tokens=rng.randint(1, 16),
                                   arrival_time=float(arrival_step) + i * 1e-3, priority=priority,
                                   first_token=rng.randint(1, 900), group_id=f"g{i}")
            if rng.random() < 0.3:
                request.deadline = arrival_step + rng.uniform(0.5, 30.0)
            arrivals.append((arrival_step, request))
    max_need = max(-(-(r.num_prompt_tokens + r.max_output_tokens - 1) // block_size) for _, r in arrivals)
    scheduler = make_priority_scheduler(num_kv_blocks=max_need + rng.randint(0, 2 * max_need),
                                        block_size=block_size, max_num_seqs=rng.randint(1, 5),
                                        max_num_batched_tokens=rng.randint(1, 32),
                                        priority_aging_steps=rng.choice([1, 3, 50]))
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, block_size)
    pending = list(arrivals)
    num_steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= num_steps:
            scheduler.add_request(pending.pop(0)[1])
        now = float(num_steps)

        def check(output: SchedulerOutput) -> None:
            for scheduled in output.scheduled:
                request = scheduler.get_request(scheduled.request_id)
                assert request is not None and (request.deadline is None or request.deadline > now)
            # A request preempted in a step is not resumed in it.
            assert not set(output.preempted_request_ids) & {s.request_id for s in output.scheduled}

        step(scheduler, runner, now=now, on_schedule=check)
        num_steps += 1
        assert num_steps < 5000, "no progress"
    assert_all_free(scheduler)
    for _, request in arrivals:
        expected = expected_output(request)
        if request.finish_reason == FinishReason.TIMEOUT:
            assert request.deadline is not None and request.finish_time is not None
            assert request.finish_time >= request.deadline
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
