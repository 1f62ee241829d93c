"""Scheduler, static policy: a new batch only when the whole previous batch has finished."""

from __future__ import annotations

from backfill.request import FinishReason
from tests.core.core_factories import (
    FakeRunner,
    assert_all_free,
    drive,
    expected_output,
    make_request,
    make_requests,
    make_scheduler,
    step,
)


def test_a_finished_slot_stays_idle_until_the_whole_batch_ends() -> None:
    scheduler = make_scheduler(policy="static", max_num_seqs=2)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    short, long, late = make_request("short", max_tokens=2), make_request("long", max_tokens=6), make_request("late")
    for request in (short, long, late):
        scheduler.add_request(request)
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled] == ["short", "long"]
    step(scheduler, runner)
    assert short.is_finished and scheduler.slot_of("short") == 0  # keeps its slot
    assert scheduler.kv_cache_manager.get_block_ids("short") == []  # but not its blocks
    while not long.is_finished:
        out, _ = step(scheduler, runner)
        assert [s.request_id for s in out.scheduled] == ["long"]
        assert scheduler.slot_states() == [("short", "idle"), ("long", "useful")]
    assert scheduler.slot_of("short") is None and scheduler.slot_of("long") is None
    out, _ = step(scheduler, runner)  # the step right after the batch ends
    assert [s.request_id for s in out.scheduled] == ["late"] and scheduler.slot_of("late") == 0
    assert scheduler.slot_states() == [("late", "useful"), (None, "empty")]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert all(r.output_token_ids == expected_output(r) for r in (short, long, late))
    assert_all_free(scheduler)


def test_finished_slots_run_growing_padding_rows_until_the_batch_ends() -> None:
    """A fixed-shape batch keeps computing a finished request's row: one padding row per held
    slot, its sequence one token longer every step; none once the batch is over, and none with
    static_padding=False or under the continuous policy."""
    for padding in (True, False):
        scheduler = make_scheduler(policy="static", max_num_seqs=3, static_padding=padding)
        runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
        a = make_request("a", prompt_len=5, max_tokens=2)
        b = make_request("b", prompt_len=3, max_tokens=3)
        c = make_request("c", prompt_len=4, max_tokens=7)
        late = make_request("late", max_tokens=2)
        for request in (a, b, c, late):
            scheduler.add_request(request)
        pads = [step(scheduler, runner)[0].padding_seq_lens for _ in range(7)]
        assert c.is_finished and not late.is_finished
        if padding:
            # a (5 + 2 tokens) ends after step 2, b (3 + 3) after step 3; c runs to step 7.
            assert pads == [[], [], [7], [8, 6], [9, 7], [10, 8], [11, 9]]
        else:
            assert pads == [[]] * 7
        out, _ = step(scheduler, runner)  # the next batch: late alone, no padding
        assert [s.request_id for s in out.scheduled] == ["late"] and out.padding_seq_lens == []
        while scheduler.has_unfinished_requests():
            step(scheduler, runner)
        assert_all_free(scheduler)
    continuous = make_scheduler(policy="continuous", max_num_seqs=3)
    assert all(not o.padding_seq_lens for o in drive(continuous, make_requests(6, max_tokens=3)))


def test_batch_prompts_are_chunked_by_the_token_budget() -> None:
    scheduler = make_scheduler(policy="static", max_num_seqs=3, max_num_batched_tokens=10)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    requests = make_requests(4, prompt_len=8, max_tokens=3)
    for request in requests:
        scheduler.add_request(request)
    out, _ = step(scheduler, runner)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("r0", 8), ("r1", 2)]
    assert scheduler.slot_states() == [("r0", "useful"), ("r1", "useful"), ("r2", "idle")]
    out, _ = step(scheduler, runner)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 6), ("r2", 3)]
    outputs = [out]
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, runner)[0])
    first_r3 = next(i for i, o in enumerate(outputs) if any(s.request_id == "r3" for s in o.scheduled))
    assert all(r.is_finished for r in requests[:3])
    assert all(requests[i].finish_time is not None and requests[i].finish_time <= first_r3 for i in range(3))
    assert all(r.output_token_ids == expected_output(r) for r in requests)
    assert_all_free(scheduler)


def test_new_arrivals_wait_for_the_next_batch_even_with_higher_priority() -> None:
    scheduler = make_scheduler(policy="static", max_num_seqs=2)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    first = make_requests(2, max_tokens=4)
    for request in first:
        scheduler.add_request(request)
    step(scheduler, runner)
    vip = make_request("vip", priority=-5, arrival_time=50.0)
    scheduler.add_request(vip)
    while any(not r.is_finished for r in first):
        out, _ = step(scheduler, runner)
        assert "vip" not in {s.request_id for s in out.scheduled}
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled] == ["vip"]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_all_free(scheduler)


def test_preempted_batch_member_keeps_its_slot_and_rejoins_before_new_arrivals() -> None:
    scheduler = make_scheduler(policy="static", num_kv_blocks=6, max_num_seqs=4)
    runner = FakeRunner(6, 4)
    requests = make_requests(6, prompt_len=6, max_tokens=12)
    for request in requests:
        scheduler.add_request(request)
    outputs = []
    while not outputs or not outputs[-1].preempted_request_ids:
        outputs.append(step(scheduler, runner, now=float(len(outputs)))[0])
    assert outputs[-1].preempted_request_ids == ["r2"]  # r0..r2 fill the pool; r3 still waits
    assert scheduler.slot_of("r2") == 2 and scheduler.slot_states()[2] == ("r2", "idle")
    assert scheduler.slot_states()[3] == ("r3", "idle")
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, runner, now=float(len(outputs)))[0])
    assert_all_free(scheduler)
    admitted = [s.request_id for o in outputs for s in o.scheduled if s.new_request is not None]
    assert admitted == ["r0", "r1", "r2", "r3", "r4", "r5"]
    finish_step = {r.request_id: r.finish_time for r in requests}
    first_step = {r.request_id: r.first_scheduled_time for r in requests}
    assert max(finish_step[f"r{i}"] for i in range(4)) < min(first_step["r4"], first_step["r5"])  # type: ignore[type-var]
    assert all(r.output_token_ids == expected_output(r) for r in requests)


def test_aborting_the_last_unfinished_member_ends_the_batch() -> None:
    scheduler = make_scheduler(policy="static", max_num_seqs=2)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    a, b, c = make_requests(3, max_tokens=20)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler, runner)
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    assert scheduler.slot_of("r0") == 0  # batch still running: the slot stays held
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled] == ["r1"] and out.finished_request_ids == ["r0"]
    scheduler.finish_requests(["r1"], FinishReason.ABORT)
    assert scheduler.slot_of("r0") is None and scheduler.slot_of("r1") is None
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled] == ["r2"]
    scheduler.finish_requests(["r2"], FinishReason.ABORT)
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)
