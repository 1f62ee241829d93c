"""Factories and a fake model runner for control-plane tests (CPU, no model, no torch).

`FakeRunner` stands in for the model runner: it writes every scheduled token into a paged
"KV cache" of plain lists through the request's block table, and samples a token that is a
hash of the whole context read back through the block table. So a request computes the same
tokens whatever the batching, and any bookkeeping error (a block handed to two requests, a
block table that changes under a running request, a token skipped or computed twice on
resume, a prefix-cache hit on a block that holds other tokens) changes the generated text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from backfill.config import EngineConfig
from backfill.core.outputs import ModelRunnerOutput, SchedulerOutput
from backfill.core.scheduler import Scheduler
from backfill.request import Request, RequestStatus
from backfill.sampling_params import SamplingParams

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 0


def make_config(**overrides: Any) -> EngineConfig:
    # NOTE: prefix caching off unless a test asks: many tests count computed tokens from zero
    # and make requests with equal prompts (tests/core/test_prefix_caching.py turns it on).
    defaults: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                                    enable_prefix_caching=False)
    defaults.update(overrides)
    return EngineConfig(**defaults)


def make_scheduler(num_kv_blocks: int = 256, **overrides: Any) -> Scheduler:
    """A scheduler over a small config; `overrides` are EngineConfig fields."""
    return Scheduler(make_config(**overrides), num_kv_blocks)


def make_request(
    request_id: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    arrival_time: float = 0.0,
    priority: int = 0,
    eos: bool = False,
    first_token: int = 1,
    group_id: str = "",
    **params: Any,
) -> Request:
    """A request whose prompt is `prompt_len` distinct non-EOS tokens. With `eos=False` it
    ignores EOS, so it generates exactly `max_tokens` tokens. `group_id` "": a group of its own."""
    prompt = [first_token + (i % (VOCAB_SIZE - 1)) for i in range(prompt_len)]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, **params),
        eos_token_ids=(EOS_TOKEN_ID,),
        priority=priority,
        arrival_time=arrival_time,
        group_id=group_id,
    )


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **kwargs: Any) -> list[Request]:
    """`n` requests named r0, r1, ... arriving in that order (arrival_time = index)."""
    return [
        make_request(f"r{i}", prompt_len, max_tokens, arrival_time=float(i), first_token=1 + i, **kwargs)
        for i in range(n)
    ]


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic hash of the whole context."""
    acc = 17
    for token_id in context:
        acc = (acc * 31 + token_id) % 1_000_003
    return acc % VOCAB_SIZE


def expected_output(request: Request) -> list[int]:
    """What the fake model generates for this request, computed without any scheduler."""
    fresh = replace(request, output_token_ids=[], token_times=[])
    while True:
        fresh.output_token_ids.append(next_token(fresh.all_token_ids))
        if fresh.check_stop():
            return fresh.output_token_ids


class FakeRunner:
    """A model runner made of lists: paged KV of token ids; samples `next_token(context)`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.known_request_ids: set[str] = set()  # requests whose NewRequestData arrived

    def run(self, output: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        self.known_request_ids.difference_update(output.finished_request_ids)
        # Prefix caching shares full cached blocks read-only; a block written this step must be
        # in no other request's table.
        tables = {s.request_id: set(s.block_ids) for s in output.scheduled}
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_tokens
            written = {s.block_ids[p // bs] for p in range(s.num_computed_tokens, end)}
            for other_id, other in tables.items():
                assert other_id == s.request_id or not written & other, "a block written while shared"
        request_ids: list[str] = []
        sampled: list[int] = []
        for s in output.scheduled:
            if s.new_request is not None:
                assert s.request_id not in self.known_request_ids, f"{s.request_id} announced twice"
                self.known_request_ids.add(s.request_id)
            assert s.request_id in self.known_request_ids, f"{s.request_id} scheduled before announced"
            end = s.num_computed_tokens + s.num_tokens
            assert len(s.block_ids) * bs >= end, "block table too short for the scheduled tokens"
            for position, token_id in enumerate(s.token_ids, start=s.num_computed_tokens):
                self.kv[s.block_ids[position // bs]][position % bs] = token_id
            if s.sample:
                context = [self.kv[s.block_ids[p // bs]][p % bs] for p in range(end)]
                assert all(t is not None for t in context)
                request_ids.append(s.request_id)
                sampled.append(next_token(context))  # type: ignore[arg-type]
        return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=sampled)


def fixed_token_output(output: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """The simplest runner: one fixed token for each request that samples."""
    request_ids = [s.request_id for s in output.scheduled if s.sample]
    return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=[token_id] * len(request_ids))


def check_step(scheduler: Scheduler, output: SchedulerOutput, decoding_before: list[Request]) -> None:
    """Invariants every schedule() must keep; `decoding_before` are the running requests that
    were one token behind before the step."""
    config = scheduler.config
    scheduled = output.scheduled
    ids = [s.request_id for s in scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert output.num_batched_tokens == sum(s.num_tokens for s in scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(scheduled) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    assert set(ids) <= {r.request_id for r in scheduler.running}
    for s in scheduled:
        request = scheduler.get_request(s.request_id)
        assert request is not None and request.status == RequestStatus.RUNNING
        assert s.num_computed_tokens == request.num_computed_tokens
        start = s.num_computed_tokens
        assert s.token_ids == request.all_token_ids[start : start + s.num_tokens] and s.num_tokens > 0
        assert s.sample == (start + s.num_tokens == request.num_tokens)
        assert s.block_ids == scheduler.kv_cache_manager.get_block_ids(s.request_id)
    for request_id in output.preempted_request_ids:
        request = scheduler.get_request(request_id)
        assert request is not None and request.status == RequestStatus.PREEMPTED
        assert request in scheduler.waiting and not scheduler.kv_cache_manager.get_block_ids(request_id)
    # Fair share hands over at most one slot a step, and only when every slot was taken.
    assert set(output.fair_share_preempted_ids) <= set(output.preempted_request_ids)
    assert len(output.fair_share_preempted_ids) <= (config.policy == "continuous")
    short_ids = set(output.preempted_request_ids) - set(output.fair_share_preempted_ids)
    if short_ids and not scheduler.by_priority:
        assert all(s.new_request is None for s in scheduled)  # no admissions when short of blocks
    elif short_ids:
        # Priority policy: only a strictly better priority is admitted past a preemption.
        worst = min(scheduler._effective_priority(r) for r in scheduler.waiting if r.request_id in short_ids)
        for s in scheduled:
            if s.new_request is not None:
                admitted = scheduler.get_request(s.request_id)
                assert admitted is not None and scheduler._effective_priority(admitted) < worst
    # Chunked prefill never starves a decode (given a budget of at least one token per slot).
    if config.max_num_batched_tokens >= config.max_num_seqs:
        for request in decoding_before:
            assert request.request_id in ids or request.request_id in (
                output.preempted_request_ids + output.timed_out_request_ids)
    # Slots: every running request holds one; those scheduled are the useful ones.
    states = scheduler.slot_states()
    assert len(states) == config.max_num_seqs
    for slot, (request_id, state) in enumerate(states):
        assert (request_id is None) == (state == "empty")
        assert (state == "useful") == (request_id in ids)
        if request_id is not None:
            assert scheduler.slot_of(request_id) == slot
    for request in scheduler.running:
        assert scheduler.slot_of(request.request_id) is not None
    # Padding rows: exactly one per slot held by a finished request (static with padding only).
    held_by_finished = [r for r, _ in states if r is not None and scheduler.get_request(r) is None]
    pads = config.policy == "static" and config.static_padding and bool(scheduled)
    assert len(output.padding_seq_lens) == (len(held_by_finished) if pads else 0)
    assert all(n >= 1 for n in output.padding_seq_lens)
    scheduler.kv_cache_manager.check_integrity()


def step(
    scheduler: Scheduler,
    runner: FakeRunner,
    now: float = 0.0,
    on_schedule: Callable[[SchedulerOutput], None] | None = None,
) -> tuple[SchedulerOutput, list[Request]]:
    """One checked engine step: schedule, run, update. `on_schedule` runs more checks on the
    state right after schedule()."""
    decoding_before = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
    output = scheduler.schedule(now=now)
    check_step(scheduler, output, decoding_before)
    if on_schedule is not None:
        on_schedule(output)
    changed = scheduler.update_from_output(output, runner.run(output), now=now)
    scheduler.kv_cache_manager.check_integrity()
    return output, changed


def drive(
    scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000, runner: FakeRunner | None = None
) -> list[SchedulerOutput]:
    """Add `requests`, run until all finish; return every step's SchedulerOutput. Pass the
    `runner` of earlier drives to keep its KV contents (prefix caching reads them)."""
    if runner is None:
        runner = FakeRunner(scheduler.kv_cache_manager.num_blocks, scheduler.config.block_size)
    for request in requests:
        scheduler.add_request(request)
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "no progress"
        outputs.append(step(scheduler, runner, now=float(len(outputs)))[0])
    assert_all_free(scheduler)
    return outputs


def assert_all_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_used_blocks == 0 and kv.usage == 0.0
