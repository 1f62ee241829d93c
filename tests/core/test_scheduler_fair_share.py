"""Fair share between client requests (groups): no fan-out can hold every slot while others wait.

The bound under test (README, "Fairness"): a request whose group has nothing running, arriving
while fewer than `max_num_seqs` groups run and no other such request waits ahead of it, samples
its first token within ceil((R + P) / (B - S + 1)) steps of the first step that sees it, where
P is its prompt length, B the token budget, S the slot count, and R the tokens the one running
request still catching up (a prompt in chunks, or a recompute) has left to compute.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from backfill.core.scheduler import Scheduler
from backfill.request import Request
from tests.core.core_factories import FakeRunner, assert_all_free, expected_output, make_request, make_scheduler, step

MAX_FAN_OUT = 256  # the server's default --max-seqs-per-request


def fan_out(group_id: str, num_seqs: int, prompt_len: int, max_tokens: int, arrival_time: float = 0.0) -> list[Request]:
    """One client request of `num_seqs` sequences (n samples of a prompt batch)."""
    return [make_request(f"{group_id}#{i}", prompt_len, max_tokens, arrival_time=arrival_time,
                         first_token=1 + i, group_id=group_id) for i in range(num_seqs)]


def running_by_group(scheduler: Scheduler) -> dict[str, int]:
    return dict(Counter(request.group_id for request in scheduler.running))


def catching_up(scheduler: Scheduler) -> int:
    """R: the tokens still to compute of running requests more than a decode behind."""
    behind = [r.num_tokens - r.num_computed_tokens for r in scheduler.running]
    assert sum(1 for b in behind if b > 1) <= 1  # only the last admitted is ever partly computed
    return sum(b for b in behind if b > 1)


def test_a_newcomer_takes_one_slot_from_the_largest_group_at_once() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    big = fan_out("big", 8, prompt_len=8, max_tokens=20)
    for request in big:
        scheduler.add_request(request)
    step(scheduler, runner)
    assert running_by_group(scheduler) == {"big": 4}
    small = make_request("small", 8, 2, arrival_time=1.0, group_id="small")
    scheduler.add_request(small)
    out, _ = step(scheduler, runner)
    # big#3 arrived with the others but was added last: the most recent of the largest group.
    assert out.fair_share_preempted_ids == out.preempted_request_ids == ["big#3"]
    assert "small" in [s.request_id for s in out.scheduled] and small.num_output_tokens == 1
    assert running_by_group(scheduler) == {"big": 3, "small": 1}
    assert scheduler.waiting[0] is big[3]  # at the head: it gets the next slot big is due
    outputs = [step(scheduler, runner)[0] for _ in range(2)]
    assert small.is_finished and not any(o.fair_share_preempted_ids for o in outputs)
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert not out.preempted_request_ids  # one move, no ping-pong
    assert scheduler.num_preemptions_total == 1
    assert all(r.output_token_ids == expected_output(r) for r in [*big, small])  # recompute is exact
    assert_all_free(scheduler)


def test_groups_converge_to_equal_shares_one_slot_a_step_and_then_stay() -> None:
    scheduler = make_scheduler(max_num_seqs=6, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    for request in fan_out("a", 12, 4, 30):
        scheduler.add_request(request)
    step(scheduler, runner)
    for request in fan_out("b", 12, 4, 30, arrival_time=1.0) + fan_out("c", 12, 4, 30, arrival_time=2.0):
        scheduler.add_request(request)
    shares = []
    for _ in range(6):
        out, _ = step(scheduler, runner)
        assert len(out.fair_share_preempted_ids) <= 1
        shares.append(running_by_group(scheduler))
    # b and c (nothing running) come first; then whoever runs fewest, never a swap of equals.
    assert shares[:4] == [{"a": 5, "b": 1}, {"a": 4, "b": 1, "c": 1}, {"a": 3, "b": 2, "c": 1},
                          {"a": 2, "b": 2, "c": 2}]
    assert shares[4] == shares[5] == {"a": 2, "b": 2, "c": 2}


def test_a_waiting_group_is_admitted_before_more_of_a_running_one() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, 4)
    first = fan_out("first", 4, 4, 3)
    late = make_request("late", 4, 3, arrival_time=5.0, group_id="late")
    for request in [*first, late]:
        scheduler.add_request(request)
    out, _ = step(scheduler, runner)
    # Two slots: the first group's head, then the late group, which runs nothing yet, before
    # the first group's second sequence although that arrived earlier.
    assert [s.request_id for s in out.scheduled] == ["first#0", "late"]


@pytest.mark.parametrize("prompt_len", [8, 150])  # 150 > the 64-token budget: chunked prefills
@pytest.mark.parametrize("arrival_step", range(1, 40, 3))
def test_first_token_within_the_bound_beside_the_largest_fan_out(prompt_len: int, arrival_step: int) -> None:
    max_num_seqs, budget = 4, 64
    scheduler = make_scheduler(num_kv_blocks=4096, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    runner = FakeRunner(4096, 4)
    for request in fan_out("big", MAX_FAN_OUT, prompt_len, max_tokens=1000):
        scheduler.add_request(request)
    for _ in range(arrival_step):
        step(scheduler, runner)
    assert set(running_by_group(scheduler)) == {"big"}  # all slots, once its prompts are in
    slots_full = scheduler.num_running == max_num_seqs
    short = make_request("short", 30, 2, arrival_time=1.0, group_id="short")
    scheduler.add_request(short)
    bound = math.ceil((catching_up(scheduler) + short.num_prompt_tokens) / (budget - max_num_seqs + 1))
    num_steps = 0
    while not short.num_output_tokens:
        step(scheduler, runner)
        num_steps += 1
    assert num_steps <= bound, (num_steps, bound)
    assert bound <= math.ceil((prompt_len + 30) / (budget - max_num_seqs + 1))  # R < one big prompt
    while not short.is_finished:
        step(scheduler, runner)
    assert short.output_token_ids == expected_output(short)
    # The one slot handed over if big held them all (else a free one); never short of blocks.
    assert scheduler.num_preemptions_total == slots_full
