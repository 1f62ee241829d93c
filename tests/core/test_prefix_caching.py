"""Prefix caching in the scheduler and KV manager: block hashes, hits, eviction, reference
counts across aborts and preemption (fake runner: a wrong hit changes the generated tokens)."""

from __future__ import annotations

import random

from backfill.core.block_pool import BlockPool, hash_block_tokens
from backfill.core.kv_cache_manager import KVCacheManager
from backfill.core.scheduler import Scheduler
from backfill.request import FinishReason, Request
from backfill.sampling_params import SamplingParams
from tests.core.core_factories import (
    EOS_TOKEN_ID,
    FakeRunner,
    assert_all_free,
    drive,
    expected_output,
    make_scheduler,
    step,
)
from tests.core.test_scheduler_random import random_workload

SYSTEM = list(range(100, 110))  # a 10-token shared prefix: not a multiple of the block size (4)


def prompt_request(request_id: str, prompt: list[int], max_tokens: int = 3, arrival_time: float = 0.0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=(EOS_TOKEN_ID,),
        arrival_time=arrival_time,
    )


def cached_scheduler(num_kv_blocks: int = 64, **overrides: object) -> Scheduler:
    return make_scheduler(num_kv_blocks=num_kv_blocks, enable_prefix_caching=True, **overrides)  # type: ignore[arg-type]


def runner_of(scheduler: Scheduler) -> FakeRunner:
    return FakeRunner(scheduler.kv_cache_manager.num_blocks, scheduler.config.block_size)


def test_block_hash_is_chained_and_covers_tokens_and_extra() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4]) and len(root) == 32
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(root, [5, 6]) != hash_block_tokens(None, [5, 6])  # the parent counts
    assert hash_block_tokens(None, [1], b"lora-a") != hash_block_tokens(None, [1], b"lora-b")
    # Fixed-width serialization: no two token lists serialize alike.
    assert hash_block_tokens(None, [1, 0]) != hash_block_tokens(None, [256])


def test_second_request_reuses_the_shared_prefix_in_whole_blocks() -> None:
    scheduler = cached_scheduler()
    runner = runner_of(scheduler)
    first = prompt_request("first", SYSTEM + [1, 2, 3])
    drive(scheduler, [first], runner=runner)
    assert first.num_cached_tokens == 0
    second = prompt_request("second", SYSTEM + [7, 8, 9, 10, 11])
    scheduler.add_request(second)
    out = scheduler.schedule()
    (item,) = out.scheduled
    # 10 shared tokens = two full blocks of 4 (the third block differs): computed from 8.
    assert item.num_computed_tokens == 8 and item.token_ids == second.prompt_token_ids[8:]
    assert item.new_request is not None and second.num_cached_tokens == 8
    assert scheduler.num_prefix_cache_queries_total == 13 + 15
    assert scheduler.num_prefix_cache_hits_total == 8
    scheduler.kv_cache_manager.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    for prompt_len in (8, 9, 12):  # exactly two blocks, one past, three blocks
        scheduler = cached_scheduler()
        runner = runner_of(scheduler)
        prompt = list(range(1, prompt_len + 1))
        a, b = prompt_request("a", prompt), prompt_request("b", prompt, arrival_time=1.0)
        drive(scheduler, [a], runner=runner)
        outputs = drive(scheduler, [b], runner=runner)
        first = outputs[0].scheduled[0]
        assert first.num_computed_tokens == (prompt_len - 1) // 4 * 4 and first.sample
        assert first.num_computed_tokens % 4 == 0 and first.num_tokens >= 1
        # the block written into is a fresh one, not one of the cached blocks a holds
        assert b.output_token_ids == a.output_token_ids == expected_output(b)


def test_blocks_are_cached_only_after_the_step_that_computes_them() -> None:
    scheduler = cached_scheduler()
    runner = FakeRunner(64, 4)
    a, b = prompt_request("a", SYSTEM + [1]), prompt_request("b", SYSTEM + [2], arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler, runner)  # both admitted in one step: b cannot hit a's blocks yet
    assert [s.num_computed_tokens for s in out.scheduled] == [0, 0]
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    c = prompt_request("c", SYSTEM + [3], arrival_time=2.0)
    scheduler.add_request(c)
    out, _ = step(scheduler, runner)
    assert [s.num_computed_tokens for s in out.scheduled if s.request_id == "c"] == [8]
    # b's duplicate blocks stayed uncached: the one block per hash is a's.
    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("c")[:2] == kv.get_block_ids("a")[:2]
    assert not set(kv.get_block_ids("b")) & set(kv.get_block_ids("a"))
    kv.check_integrity()


def test_chunked_prompt_registers_blocks_as_its_chunks_complete() -> None:
    scheduler = cached_scheduler(max_num_batched_tokens=6)
    runner = FakeRunner(64, 4)
    long = prompt_request("long", list(range(1, 21)))
    scheduler.add_request(long)
    step(scheduler, runner)  # positions 0..5: block 0 full
    pool = scheduler.kv_cache_manager.block_pool
    table = scheduler.kv_cache_manager.get_block_ids("long")
    assert pool.blocks[table[0]].block_hash is not None and pool.blocks[table[1]].block_hash is None
    other = prompt_request("other", list(range(1, 7)) + [99], arrival_time=1.0)
    scheduler.add_request(other)
    while other.first_scheduled_time is None:  # long takes the whole budget first
        out, _ = step(scheduler, runner)
    assert {s.request_id: s.num_computed_tokens for s in out.scheduled}["other"] == 4
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert other.output_token_ids == expected_output(other) and long.output_token_ids == expected_output(long)


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first() -> None:
    scheduler = cached_scheduler(num_kv_blocks=6)
    runner = runner_of(scheduler)
    kv = scheduler.kv_cache_manager
    old = prompt_request("old", list(range(1, 9)), max_tokens=1)  # 8 tokens: 2 full blocks
    new = prompt_request("new", list(range(50, 58)), max_tokens=1, arrival_time=1.0)
    drive(scheduler, [old], runner=runner)
    drive(scheduler, [new], runner=runner)
    assert kv.num_cached_free_blocks == 4 and kv.num_used_blocks == 0 and kv.usage == 0.0
    # A 9-token request needs 3 blocks: the 2 never used, then the least recently freed: old's
    # tail block (a sequence is freed tail first). new's blocks and old's head survive.
    big = prompt_request("big", list(range(200, 209)), max_tokens=1, arrival_time=2.0)
    drive(scheduler, [big], runner=runner)
    assert kv.num_cached_free_blocks == 1 + 2 + 2  # old's head, new's two, big's two full blocks
    again_old = prompt_request("again_old", list(range(1, 9)) + [1], max_tokens=1, arrival_time=3.0)
    assert len(kv.find_cached_blocks(again_old)) == 1
    kv.free(again_old)  # drop the memoized hashes of that look-up
    again_new = prompt_request("again_new", list(range(50, 58)) + [1], max_tokens=1, arrival_time=3.0)
    drive(scheduler, [again_new], runner=runner)
    assert again_new.num_cached_tokens == 8
    assert again_new.output_token_ids == expected_output(again_new)


def test_pressure_evicts_cached_blocks_rather_than_refusing_work() -> None:
    scheduler = cached_scheduler(num_kv_blocks=8)
    runner = runner_of(scheduler)
    requests = [prompt_request(f"r{i}", [i * 100 + t for t in range(12)], max_tokens=2, arrival_time=i)
                for i in range(6)]
    for request in requests:
        drive(scheduler, [request], runner=runner)  # each leaves 3 cached blocks; the pool holds 8
        assert request.output_token_ids == expected_output(request)
    assert scheduler.kv_cache_manager.num_cached_free_blocks <= 8
    assert scheduler.num_preemptions_total == 0


def test_abort_of_one_sharer_keeps_the_blocks_of_the_other() -> None:
    scheduler = cached_scheduler()
    runner = FakeRunner(64, 4)
    kv = scheduler.kv_cache_manager
    drive(scheduler, [prompt_request("warm", SYSTEM + [0], max_tokens=1)], runner=runner)
    a = prompt_request("a", SYSTEM + [1], max_tokens=6, arrival_time=1.0)
    b = prompt_request("b", SYSTEM + [2], max_tokens=6, arrival_time=2.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared
    assert [kv.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    kv.check_integrity()
    assert [kv.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert b.output_token_ids == expected_output(b)
    assert_all_free(scheduler)
    scheduler.finish_requests(["b"], FinishReason.ABORT)  # finished already: ignored


def test_abort_while_waiting_drops_its_memoized_hashes() -> None:
    scheduler = cached_scheduler(max_num_seqs=1)
    runner = FakeRunner(64, 4)
    first, second = prompt_request("first", SYSTEM), prompt_request("second", SYSTEM, arrival_time=1.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler, runner)  # second waits for the only slot (after a lookup)
    scheduler.finish_requests(["second"], FinishReason.ABORT)
    assert "second" not in scheduler.kv_cache_manager._block_hashes
    scheduler.kv_cache_manager.check_integrity()


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    # old and new share nothing; new is preempted when the pool runs dry, and on resume finds
    # its own computed blocks (prompt and generated tokens) still cached.
    scheduler = cached_scheduler(num_kv_blocks=7, max_num_seqs=2)
    runner = FakeRunner(7, 4)
    old = prompt_request("old", list(range(1, 9)), max_tokens=12)
    new = prompt_request("new", list(range(500, 509)), max_tokens=10, arrival_time=1.0)
    scheduler.add_request(old)
    scheduler.add_request(new)
    resumed_at = None
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        for item in out.scheduled:
            if item.request_id == "new" and new.num_preemptions and resumed_at is None:
                resumed_at = item.num_computed_tokens
    assert new.num_preemptions >= 1 and resumed_at is not None and resumed_at > 0
    assert new.num_cached_tokens == 0  # reported for the first admission only
    assert old.output_token_ids == expected_output(old) and new.output_token_ids == expected_output(new)
    assert_all_free(scheduler)


def test_static_policy_with_shared_prompts() -> None:
    scheduler = cached_scheduler(policy="static", max_num_seqs=2)
    runner = runner_of(scheduler)
    requests = [prompt_request(f"r{i}", SYSTEM + [i] * (i + 1), max_tokens=2 + i, arrival_time=i) for i in range(5)]
    drive(scheduler, requests, runner=runner)
    for request in requests:
        assert request.output_token_ids == expected_output(request)
    assert any(request.num_cached_tokens == 8 for request in requests[2:])


def test_random_workloads_with_shared_prefixes_hit_the_cache() -> None:
    """tests/core/test_scheduler_random.py runs these workloads to completion; check they share."""
    num_with_hits = 0
    for seed in range(20):
        scheduler, arrivals = random_workload(random.Random(seed * 2), "continuous", prefix_caching=True)
        requests = [request for _, request in arrivals]
        drive(scheduler, requests)
        num_with_hits += scheduler.num_prefix_cache_hits_total > 0
        assert scheduler.num_prefix_cache_hits_total == sum(r.num_cached_tokens for r in requests)
        assert scheduler.num_prefix_cache_queries_total == sum(r.num_prompt_tokens for r in requests)
    assert num_with_hits >= 10


def test_caching_off_never_shares() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = runner_of(scheduler)
    a, b = prompt_request("a", SYSTEM), prompt_request("b", SYSTEM, arrival_time=1.0)
    drive(scheduler, [a], runner=runner)
    drive(scheduler, [b], runner=runner)
    assert b.num_cached_tokens == 0 and scheduler.kv_cache_manager.num_cached_free_blocks == 0


def test_pool_and_manager_integrity_catch_a_bad_hash_map() -> None:
    pool = BlockPool(4)
    (block_id,) = pool.allocate(1)
    assert pool.cache_block(block_id, hash_block_tokens(None, [1]))
    (other,) = pool.allocate(1)
    assert not pool.cache_block(other, hash_block_tokens(None, [1]))  # one block per hash
    pool.free([block_id, other])
    assert pool.num_cached_free_blocks == 1
    pool.check_integrity()
    pool.blocks[block_id].block_hash = None  # corrupt it
    try:
        pool.check_integrity()
    except AssertionError:
        pass
    else:
        raise AssertionError("check_integrity missed a hash map that disagrees with the blocks")
    kv = KVCacheManager(4, 4, enable_prefix_caching=True)
    kv.check_integrity()
