"""Scheduler, continuous policy: budgets, chunked prefill, slots, preemption, abort, priority."""

from __future__ import annotations

import pytest

from backfill.core.outputs import ModelRunnerOutput
from backfill.request import FinishReason, RequestStatus
from tests.core.core_factories import (
    EOS_TOKEN_ID,
    FakeRunner,
    assert_all_free,
    drive,
    expected_output,
    fixed_token_output,
    make_request,
    make_requests,
    make_scheduler,
    step,
)


def test_one_request_prefill_then_decode_then_finish() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=8, max_tokens=3)
    scheduler.add_request(request)
    assert scheduler.num_waiting == 1 and scheduler.has_unfinished_requests()

    out = scheduler.schedule(now=1.0)
    (item,) = out.scheduled
    assert item.token_ids == request.prompt_token_ids and item.num_computed_tokens == 0 and item.sample
    assert item.new_request is not None and item.new_request.prompt_token_ids == request.prompt_token_ids
    assert len(item.block_ids) == 2 and out.num_batched_tokens == 8
    assert request.status == RequestStatus.RUNNING and request.first_scheduled_time == 1.0
    assert scheduler.slot_of("a") == 0 and scheduler.slot_states()[0] == ("a", "useful")
    assert scheduler.update_from_output(out, fixed_token_output(out, 7), now=2.0) == [request]
    assert request.output_token_ids == [7] and request.num_computed_tokens == 8
    assert request.first_token_time == 2.0

    out = scheduler.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [7] and item.num_computed_tokens == 8 and item.sample
    assert item.new_request is None and len(item.block_ids) == 3  # position 8 opens block 3
    scheduler.update_from_output(out, fixed_token_output(out, 8))
    out = scheduler.schedule()
    changed = scheduler.update_from_output(out, fixed_token_output(out, 9), now=5.0)

    assert changed == [request] and request.output_token_ids == [7, 8, 9]
    assert request.status == RequestStatus.FINISHED and request.finish_reason == FinishReason.LENGTH
    assert request.finish_time == 5.0 and request.token_times[-1] == 5.0
    assert not scheduler.has_unfinished_requests() and scheduler.get_request("a") is None
    assert scheduler.slot_of("a") is None
    assert_all_free(scheduler)
    out = scheduler.schedule()
    assert out.is_empty and out.finished_request_ids == ["a"]
    assert scheduler.schedule().finished_request_ids == []  # reported once


def test_eos_stops_after_min_tokens() -> None:
    scheduler = make_scheduler()
    eager = make_request("eager", max_tokens=10, eos=True)
    patient = make_request("patient", max_tokens=10, eos=True, min_tokens=3)
    scheduler.add_request(eager)
    scheduler.add_request(patient)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, fixed_token_output(out, EOS_TOKEN_ID))
    assert eager.output_token_ids == [EOS_TOKEN_ID] and eager.finish_reason == FinishReason.STOP
    assert patient.num_output_tokens == 3 and patient.finish_reason == FinishReason.STOP
    assert_all_free(scheduler)


def test_token_budget_and_max_num_seqs_bind_every_step() -> None:
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    requests = make_requests(8, prompt_len=10, max_tokens=5)
    outputs = drive(scheduler, requests)  # check_step asserts both caps on every step
    assert max(out.num_batched_tokens for out in outputs) == 20
    assert max(len(out.scheduled) for out in outputs) == 3
    assert all(r.output_token_ids == expected_output(r) for r in requests)


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = make_request("long", prompt_len=50, max_tokens=2)
    outputs = drive(scheduler, [request])
    items = [out.scheduled[0] for out in outputs]
    assert [item.num_tokens for item in items] == [16, 16, 16, 2, 1]
    assert [item.num_computed_tokens for item in items] == [0, 16, 32, 48, 50]
    assert [item.sample for item in items] == [False, False, False, True, True]
    assert [item.new_request is not None for item in items] == [True, False, False, False, False]
    assert request.first_token_time == 3.0  # sampled only once the whole prompt is computed
    assert request.output_token_ids == expected_output(request)


def test_chunked_prefill_never_starves_running_decodes() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    decoders = make_requests(3, prompt_len=4, max_tokens=30)
    for request in decoders:
        scheduler.add_request(request)
    step(scheduler, runner)  # all three prompts in one step
    long = make_request("long", prompt_len=40, max_tokens=2, arrival_time=10.0)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = step(scheduler, runner)
        counts = {item.request_id: item.num_tokens for item in out.scheduled}
        assert all(counts[r.request_id] == 1 for r in decoders)
        chunks.append(counts["long"])
    assert chunks == [13, 13, 13, 1]


def test_continuous_refills_a_finished_slot_in_the_next_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    short, long, late = make_request("short", max_tokens=2), make_request("long", max_tokens=6), make_request("late")
    for request in (short, long, late):
        scheduler.add_request(request)
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled] == ["short", "long"] and scheduler.num_waiting == 1
    slot = scheduler.slot_of("short")
    out, changed = step(scheduler, runner)
    assert short.is_finished and short in changed and scheduler.slot_of("short") is None
    out, _ = step(scheduler, runner)  # the very next step
    assert [s.request_id for s in out.scheduled] == ["long", "late"]
    assert scheduler.slot_of("late") == slot and out.finished_request_ids == ["short"]
    assert scheduler.slot_states()[slot] == ("late", "useful")


def test_preemption_and_resumption_lose_no_request_and_no_token() -> None:
    def run(num_kv_blocks: int) -> tuple[dict[str, list[int]], int, list[list[str]]]:
        scheduler = make_scheduler(num_kv_blocks=num_kv_blocks, max_num_seqs=4)
        requests = make_requests(6, prompt_len=6, max_tokens=12)
        outputs = drive(scheduler, requests)
        assert all(r.finish_reason == FinishReason.LENGTH for r in requests)
        preempted = [out.preempted_request_ids for out in outputs if out.preempted_request_ids]
        assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions_total
        return {r.request_id: r.output_token_ids for r in requests}, scheduler.num_preemptions_total, preempted

    reference, num_reference_preemptions, _ = run(num_kv_blocks=1000)
    outputs, num_preemptions, preempted = run(num_kv_blocks=6)
    assert num_reference_preemptions == 0 and num_preemptions > 0
    assert outputs == reference
    assert preempted[0] == ["r2"]  # r0..r2 fill the pool; r2 is the most recently arrived


def test_preempted_request_goes_to_the_head_and_is_not_announced_again() -> None:
    scheduler = make_scheduler(num_kv_blocks=3, max_num_seqs=2)
    runner = FakeRunner(3, 4)
    old, new = make_request("old", 4, 5, arrival_time=0.0), make_request("new", 2, 7, arrival_time=1.0)
    for request in (old, new):
        scheduler.add_request(request)
    queued = make_request("queued", 1, 1, arrival_time=2.0)
    outputs = [step(scheduler, runner)[0] for _ in range(3)]
    scheduler.add_request(queued)
    out, _ = step(scheduler, runner)  # new needs its 2nd block, none free: it is the most recent
    assert out.preempted_request_ids == ["new"] and [s.request_id for s in out.scheduled] == ["old"]
    assert list(scheduler.waiting) == [new, queued] and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1 and scheduler.slot_of("new") is None
    assert all(s.preempted_request_ids == [] for s in outputs)
    while not new.num_computed_tokens:
        out, _ = step(scheduler, runner)
    (resumed,) = [s for s in out.scheduled if s.request_id == "new"]
    assert resumed.new_request is None and resumed.num_computed_tokens == 0
    assert resumed.token_ids == new.all_token_ids[: resumed.num_tokens]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert all(r.output_token_ids == expected_output(r) for r in (old, new, queued))
    assert_all_free(scheduler)


def test_a_victim_already_scheduled_this_step_has_its_work_taken_back() -> None:
    # running is [low, high] in admission order, but high has the better priority: when high
    # runs short, low (scheduled earlier in the same step) is the victim.
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2)
    runner = FakeRunner(4, 4)
    low = make_request("low", 4, 9, priority=1, arrival_time=0.0)
    high = make_request("high", 8, 5, priority=0, arrival_time=1.0)
    scheduler.add_request(low)
    step(scheduler, runner)
    scheduler.add_request(high)
    step(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert out.preempted_request_ids == ["low"]
    assert [s.request_id for s in out.scheduled] == ["high"] and out.num_batched_tokens == 1
    assert low.num_output_tokens == 2 and low.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert low.output_token_ids == expected_output(low) and high.output_token_ids == expected_output(high)
    assert_all_free(scheduler)


def test_a_request_needing_the_whole_pool_runs_alone() -> None:
    scheduler = make_scheduler(num_kv_blocks=3)
    requests = [make_request("a", 4, 9), make_request("b", 4, 9, arrival_time=1.0)]
    drive(scheduler, requests)
    assert all(r.output_token_ids == expected_output(r) for r in requests)


def test_add_request_rejects_what_can_never_fit() -> None:
    scheduler = make_scheduler(num_kv_blocks=3)  # 12 token positions
    scheduler.add_request(make_request("fits", 4, 9))  # 12 positions: the last token is never fed
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("too-long", 4, 10))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("unbounded", 4, max_tokens=None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("fits", 1, 1))
    assert [r.request_id for r in scheduler.waiting] == ["fits"]


def test_abort_waiting_and_running_requests_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    running, waiting = make_requests(2, prompt_len=8, max_tokens=10)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert scheduler.kv_cache_manager.num_used_blocks == 2

    assert scheduler.finish_requests(["r1", "unknown"], FinishReason.ABORT, now=3.0) == [waiting]
    assert waiting.status == RequestStatus.FINISHED and waiting.finish_reason == FinishReason.ABORT
    assert waiting.finish_time == 3.0 and scheduler.num_waiting == 0
    assert scheduler.finish_requests(["r0"], FinishReason.ABORT) == [running]
    assert scheduler.num_running == 0 and scheduler.slot_of("r0") is None
    assert_all_free(scheduler)
    assert scheduler.finish_requests(["r0"], FinishReason.ABORT) == []  # already gone
    out = scheduler.schedule()
    assert out.is_empty and out.finished_request_ids == ["r1", "r0"]


def test_abort_between_schedule_and_update_is_skipped() -> None:
    scheduler = make_scheduler()
    a, b = make_requests(2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    assert scheduler.update_from_output(out, fixed_token_output(out)) == [b]
    assert a.num_output_tokens == 0 and a.finish_reason == FinishReason.ABORT
    assert scheduler.schedule().finished_request_ids == ["r0"]
    scheduler.finish_requests(["r1"], FinishReason.ABORT)
    assert_all_free(scheduler)


def test_runner_output_must_match_the_sampling_requests() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    out = scheduler.schedule()
    with pytest.raises(AssertionError):
        scheduler.update_from_output(out, ModelRunnerOutput(request_ids=[], sampled_token_ids=[]))


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    priorities = {"r0": 2, "r1": 0, "r2": 1, "r3": 0, "r4": 2}
    requests = [make_request(rid, 4, 2, priority=p, arrival_time=float(i)) for i, (rid, p) in enumerate(priorities.items())]
    outputs = drive(scheduler, requests)
    admitted = [s.request_id for out in outputs for s in out.scheduled if s.new_request is not None]
    assert admitted == ["r1", "r3", "r2", "r0", "r4"]


def test_a_late_high_priority_request_jumps_the_queue() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    for request in make_requests(3, max_tokens=2):
        scheduler.add_request(request)
    step(scheduler, runner)
    scheduler.add_request(make_request("vip", priority=-1, arrival_time=99.0))
    assert [r.request_id for r in scheduler.waiting] == ["vip", "r1", "r2"]
