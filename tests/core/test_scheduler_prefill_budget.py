"""The prompt budget beside decoding streams: while any request decodes, a step's prompt chunks
take at most `prefill_budget` units (a prompt token at position p costs 1 + context_cost * p),
so a long prompt cannot stall the streams; with nothing decoding a prompt takes the whole
token budget. Decodes are never held back, and every prompt progresses each step."""

from __future__ import annotations

import pytest

from backfill.core.prefill_budget import PrefillBudget
from backfill.core.scheduler import Scheduler
from tests.core.core_factories import FakeRunner, assert_all_free, expected_output, make_config, make_request, step


def make(prefill_budget: int | None, context_cost: float = 0.0, **overrides: object) -> tuple[Scheduler, FakeRunner]:
    config = make_config(max_num_seqs=8, max_num_batched_tokens=512, **overrides)
    scheduler = Scheduler(config, 512, prefill_budget, context_cost)
    return scheduler, FakeRunner(scheduler.kv_cache_manager.num_blocks, config.block_size)


def prompt_tokens(output: object, long_id: str) -> int:
    return sum(s.num_tokens for s in output.scheduled if s.request_id == long_id)  # type: ignore[attr-defined]


@pytest.mark.parametrize("context_cost", [0.0, 1 / 64])
def test_a_long_prompt_is_chunked_within_the_budget_while_streams_decode(context_cost: float) -> None:
    scheduler, runner = make(16, context_cost)
    streams = [make_request(f"s{i}", 4, 200, first_token=1 + i, group_id=f"s{i}") for i in range(4)]
    for request in streams:
        scheduler.add_request(request)
    step(scheduler, runner)  # the four short prompts: nothing decodes yet, whole budget
    long = make_request("long", 400, 2, arrival_time=1.0, first_token=50, group_id="long")
    scheduler.add_request(long)
    budget = PrefillBudget(16, context_cost)
    chunks = []
    while long.num_output_tokens == 0:
        start = long.num_computed_tokens
        output, _ = step(scheduler, runner)
        # every stream decodes in every step
        assert {s.request_id for s in output.scheduled if s.num_tokens == 1} >= {r.request_id for r in streams}
        num = prompt_tokens(output, "long")
        assert num >= 1  # progress every step
        assert budget.cost(start, num) <= 16  # within the budget
        chunks.append(num)
    assert sum(chunks) == 400
    if context_cost == 0:
        assert set(chunks) == {16}  # 25 steps of exactly the budget
    else:  # the context makes later tokens dearer: chunks shrink as the prompt grows
        assert chunks[-1] < chunks[0] <= 16 and chunks == sorted(chunks, reverse=True)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert all(r.output_token_ids == expected_output(r) for r in [*streams, long])
    assert_all_free(scheduler)


def test_with_nothing_decoding_a_prompt_takes_the_whole_token_budget() -> None:
    scheduler, runner = make(16)
    long = make_request("long", 400, 2)
    scheduler.add_request(long)
    output, _ = step(scheduler, runner)
    assert prompt_tokens(output, "long") == 400


def test_no_limit_when_the_budget_is_none() -> None:
    scheduler, runner = make(None)
    stream = make_request("s", 4, 50)
    scheduler.add_request(stream)
    step(scheduler, runner)
    long = make_request("long", 400, 2, arrival_time=1.0, first_token=9, group_id="long")
    scheduler.add_request(long)
    output, _ = step(scheduler, runner)
    assert prompt_tokens(output, "long") == 400 and stream.num_output_tokens == 2


def test_one_prompt_token_a_step_even_when_it_alone_exceeds_the_budget() -> None:
    # context_cost 1: a token at position 100 costs 101 units, far over the budget of 4
    scheduler, runner = make(4, 1.0)
    stream = make_request("s", 4, 300)
    scheduler.add_request(stream)
    step(scheduler, runner)
    long = make_request("long", 120, 1, arrival_time=1.0, first_token=9, group_id="long")
    scheduler.add_request(long)
    counts = []
    while long.num_output_tokens == 0:
        output, _ = step(scheduler, runner)
        counts.append(prompt_tokens(output, "long"))
    assert counts[:2] == [2, 1] and set(counts[2:]) == {1}  # 1 + 2 units, then 3 units: one a step
    assert sum(counts) == 120


def test_two_prompts_share_one_budget() -> None:
    scheduler, runner = make(16)
    stream = make_request("s", 4, 100)
    scheduler.add_request(stream)
    step(scheduler, runner)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 40, 2, arrival_time=1.0, first_token=20, group_id=name))
    output, _ = step(scheduler, runner)
    assert prompt_tokens(output, "a") + prompt_tokens(output, "b") == 16


def test_chunk_len_is_the_largest_chunk_within_the_budget() -> None:
    for cost in (0.0, 0.001, 0.37, 5.0):
        budget = PrefillBudget(50, cost)
        request = make_request("r", 5000, 1)
        for start in (0, 1, 17, 999, 4000):
            request.num_computed_tokens = start
            n = budget.chunk_len(request, 10_000)
            assert n >= 1 and (budget.cost(start, n) <= 50 or n == 1)
            assert budget.cost(start, n + 1) > 50
