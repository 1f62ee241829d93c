"""Drive-to-completion property test: random workloads, both policies, small KV pools.

Every request either finishes with exactly the tokens the fake model generates alone
(`expected_output`), or is aborted with a prefix of them; the pool ends empty; and each step
keeps the per-step invariants of `check_step` plus the policy's admission rule.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from backfill.core.outputs import SchedulerOutput
from backfill.core.scheduler import Scheduler
from backfill.request import FinishReason, Request
from tests.core.core_factories import (
    FakeRunner,
    assert_all_free,
    expected_output,
    make_request,
    make_scheduler,
    step,
)


def random_workload(
    rng: random.Random, policy: str, prefix_caching: bool = False
) -> tuple[Scheduler, list[tuple[int, Request]]]:
    """With `prefix_caching`, prompts start from one of a few first tokens, so many share a
    prefix (of any length: make_request's prompts count up from their first token)."""
    block_size = rng.choice([1, 2, 4, 8])
    max_num_seqs = rng.randint(1, 6)
    requests: list[tuple[int, Request]] = []  # (arrival step, request)
    arrival_step = 0
    for i in range(rng.randint(1, 24)):
        arrival_step += rng.choice([0, 0, 1, 3])
        priority = rng.choice([0, 0, 0, 1, -1])
        # One client request: 1 to 6 sequences (its n samples, its prompts) in one group.
        for k in range(rng.choice([1, 1, 2, 6])):
            request = make_request(
                f"r{i}.{k}",
                prompt_len=rng.randint(1, 30),
                max_tokens=rng.randint(1, 20),
                arrival_time=float(arrival_step) + i * 1e-3,
                priority=priority,
                eos=rng.random() < 0.5,
                first_token=rng.choice([1, 1, 7, rng.randint(1, 900)]) if prefix_caching else rng.randint(1, 900),
                group_id=f"g{i}",
            )
            requests.append((arrival_step, request))
    max_need = max(-(-(r.num_prompt_tokens + r.max_output_tokens - 1) // block_size) for _, r in requests)
    num_kv_blocks = max_need + rng.randint(0, 2 * max_need)  # often short: preemption happens
    scheduler = make_scheduler(
        num_kv_blocks=num_kv_blocks,
        policy=policy,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(1, 48),
        enable_prefix_caching=prefix_caching,
    )
    return scheduler, requests


def check_admission_rule(scheduler: Scheduler, budget_left: int, preempted: bool) -> None:
    """Nothing admissible is left waiting: the scheduler is work-conserving within its policy."""
    waiting = list(scheduler.waiting)
    if scheduler.policy == "static":
        # A batch is always in progress while anyone waits; only its members may be admitted.
        assert not waiting or any(request_id is not None for request_id, _ in scheduler.slot_states())
        candidates = [r for r in waiting if scheduler.slot_of(r.request_id) is not None]
    else:
        # Fair share: within the head's priority, the group running the fewest goes first.
        num_running = Counter(r.group_id for r in scheduler.running)
        same_priority = [r for r in waiting if r.priority == waiting[0].priority]
        candidates = sorted(same_priority, key=lambda r: num_running[r.group_id])[:1]  # stable
        if candidates and scheduler.num_running == scheduler.config.max_num_seqs:
            return
    if not candidates or preempted or budget_left == 0:
        return
    head = candidates[0]
    kv = scheduler.kv_cache_manager
    cached_block_ids = kv.find_cached_blocks(head)
    head.num_computed_tokens = len(cached_block_ids) * kv.block_size  # as admission would
    num_new_tokens = min(head.num_tokens - head.num_computed_tokens, budget_left)
    admissible = kv.can_allocate(head, num_new_tokens, cached_block_ids)
    head.num_computed_tokens = 0
    assert not admissible, f"{head.request_id} left waiting"


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_run_to_completion(policy: str, seed: int, prefix_caching: bool) -> None:
    rng = random.Random(seed * 2 + (policy == "static"))
    scheduler, arrivals = random_workload(rng, policy, prefix_caching)
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, scheduler.config.block_size)
    pending = list(arrivals)
    aborted: set[str] = set()
    batches: list[set[str]] = []  # static: the slot holders of each batch, in order
    num_steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= num_steps:
            scheduler.add_request(pending.pop(0)[1])
        live = list(scheduler.waiting) + scheduler.running
        if live and rng.random() < 0.05:
            victim = rng.choice(live).request_id
            assert scheduler.finish_requests([victim], FinishReason.ABORT)
            aborted.add(victim)
            scheduler.kv_cache_manager.check_integrity()

        def check(output: SchedulerOutput) -> None:
            budget_left = scheduler.config.max_num_batched_tokens - output.num_batched_tokens
            check_admission_rule(scheduler, budget_left, bool(output.preempted_request_ids))
            if policy == "static":
                holders = {request_id for request_id, _ in scheduler.slot_states() if request_id is not None}
                if holders and (not batches or not holders <= batches[-1]):
                    # A new batch: disjoint from the last, which must be entirely finished.
                    if batches:
                        assert not holders & batches[-1]
                        assert all(scheduler.get_request(rid) is None for rid in batches[-1])
                    batches.append(holders)

        step(scheduler, runner, now=float(num_steps), on_schedule=check)
        num_steps += 1
        assert num_steps < 5000, "no progress"

    assert_all_free(scheduler)
    assert not scheduler.waiting and not scheduler.running
    for _, request in arrivals:
        assert request.is_finished and request.finish_time is not None
        expected = expected_output(request)
        if request.request_id in aborted:
            assert request.finish_reason == FinishReason.ABORT
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    total_preemptions = sum(r.num_preemptions for _, r in arrivals)
    assert total_preemptions == scheduler.num_preemptions_total


def test_some_random_workloads_preempt() -> None:
    """The property test above is only meaningful if its pools are short often enough, and if
    its clients arrive unevenly enough for fair share to move slots between them."""
    num_short_of_blocks = num_fair_share = 0
    for seed in range(40):
        scheduler, arrivals = random_workload(random.Random(seed * 2), "continuous")
        runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, scheduler.config.block_size)
        num_steps = num_rebalanced = 0
        while arrivals or scheduler.has_unfinished_requests():
            while arrivals and arrivals[0][0] <= num_steps:
                scheduler.add_request(arrivals.pop(0)[1])
            output, _ = step(scheduler, runner)
            num_rebalanced += len(output.fair_share_preempted_ids)
            num_steps += 1
        num_short_of_blocks += scheduler.num_preemptions_total > num_rebalanced
        num_fair_share += num_rebalanced > 0
    assert num_short_of_blocks >= 5 and num_fair_share >= 3
