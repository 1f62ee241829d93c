"""Scheduler: decides, every step, which requests run and how many tokens each computes."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from backfill.config import EngineConfig
from backfill.core.kv_cache_manager import KVCacheManager
from backfill.core.outputs import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from backfill.core.prefill_budget import PrefillBudget
from backfill.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)

SLOT_USEFUL, SLOT_IDLE, SLOT_EMPTY = "useful", "idle", "empty"


class Scheduler:
    """Owns the waiting and running queues, the KV cache manager and the batch slots.

    `waiting` holds requests that hold no KV blocks, in priority order (lower `priority`
    first, then arrival), preempted ones at the head. `running` holds admitted requests in
    admission order; every one of them holds the blocks of its computed tokens.

    Slots model the `max_num_seqs` rows of the batch: each admitted request gets the lowest
    free slot. With `policy="continuous"` a slot is released as soon as its request finishes
    or is preempted; with `policy="static"` every slot of a batch is held until the whole
    batch has finished, and only then is the next batch admitted. With `static_padding` (the
    default) a held slot is also computed, as a padding row: a fixed-shape batch's cost.

    Fair share (continuous): the sequences of one client request (`Request.group_id`) form a
    group; a waiting request of the group running the fewest goes first, and with every slot
    taken a group running two fewer than the largest takes one slot a step from it (see
    `_rebalance`). A newcomer's first token then comes within ceil((R + P) / (B - S + 1)) steps
    (README, "Fairness"; tests/core/test_scheduler_fair_share.py).

    Priorities (`scheduling_policy="priority"`, continuous): a waiting request whose effective
    priority is strictly better than the worst running one's preempts it when it finds no slot or
    no KV blocks; never the reverse. The effective priority is `priority` minus one level per
    `priority_aging_steps` steps since arrival (for waiting and running requests alike): the
    order is by `priority + arrival_step / priority_aging_steps`, so a request of priority p is
    overtaken only by requests that arrived before it or within `(p - p_best) *
    priority_aging_steps` steps after it: its wait is bounded by their work, whatever arrives
    later (tests/core/test_scheduler_priority.py). A preempted request goes
    back to its place in the queue (effective priority, then arrival). Under "fcfs" requests are
    still ordered by `priority` (the server sends 0 for all), without aging or such preemption.

    Deadlines: a request with a `deadline` still unfinished when a `schedule()` starts at or
    after it is finished with `FinishReason.TIMEOUT` before anything is scheduled (reported in
    `SchedulerOutput.timed_out_request_ids`): a waiting one never reaches the model.

    A step is `schedule()`, the model run, then `update_from_output()`; `finish_requests()`
    (abort, stop string) may come between steps.
    """

    def __init__(
        self, config: EngineConfig, num_kv_blocks: int, prefill_budget: int | None = None, context_cost: float = 0.0
    ) -> None:
        """`prefill_budget`: while any request decodes, the units of prompt work a step may
        take (see PrefillBudget; None: no limit but `max_num_batched_tokens`); LLMEngine passes
        `config.resolved_prefill_budget()`. `context_cost`: a prompt token's attention cost per
        token of context before it, in units of its own linear-layer cost (LLMEngine derives it
        from the model; 0 counts every prompt token as 1 unit)."""
        self.config = config
        self.policy = config.policy
        self.by_priority = config.scheduling_policy == "priority" and config.policy == "continuous"
        self.priority_aging_steps = config.priority_aging_steps
        self.num_steps = 0  # schedule() calls so far
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_budget = prefill_budget
        self.context_cost = context_cost
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        # Prefix cache, in prompt tokens, counted once per request (at its first admission)
        self.num_prefix_cache_queries_total = 0
        self.num_prefix_cache_hits_total = 0
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._arrival_index: dict[str, int] = {}  # breaks ties between equal arrival times
        self._num_arrivals = 0
        self._finished_request_ids: list[str] = []  # finished or aborted since the last schedule()
        # Ended by the last update_from_output with no token: their grammar rejected it.
        self.constraint_failed_request_ids: list[str] = []
        self._deadlines: dict[str, float] = {}  # request_id -> deadline, for those that have one
        self._slots: list[str | None] = [None] * self.max_num_seqs
        self._slot_by_request_id: dict[str, int] = {}
        # group_id -> its sequences in `running` / in `waiting` (only groups with some)
        self._num_running_by_group: dict[str, int] = {}
        self._num_waiting_by_group: dict[str, int] = {}
        self._batch_request_ids: set[str] = set()  # static: unfinished members of the current batch
        # static with padding: finished members of the current batch -> their padding row's
        # sequence length (it grows by one every step, as the row would in a fixed-shape batch)
        self._padding_lens: dict[str, int] = {}
        # Per slot, as the last schedule() left them (see slot_states): new lists every step.
        self._slot_ids: list[str | None] = [None] * self.max_num_seqs
        self._slot_states: list[str] = [SLOT_EMPTY] * self.max_num_seqs

    # ---------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_by_request_id.get(request_id)

    def slot_states(self) -> list[tuple[str | None, str]]:
        """Per slot, for the step last scheduled: (request_id or None, "useful" | "idle" | "empty").

        useful: its request was scheduled; idle: held by a request that was not (static: finished
        and waiting for its batch; or starved of budget or blocks); empty: no request.
        """
        return list(zip(self._slot_ids, self._slot_states))

    def last_slots(self) -> tuple[list[str | None], list[str]]:
        """slot_states() as two lists, request ids and states, without a copy: each schedule()
        makes new ones, so they may be kept (and must not be changed)."""
        return self._slot_ids, self._slot_states

    # --------------------------------------------------------------- requests in

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if its id is live or if even the whole KV pool
        could not hold its longest possible sequence (it would wait forever)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} is not new ({request.status.value})")
        # The last sampled token is never fed back, so its K/V is never computed.
        max_num_tokens = request.num_prompt_tokens + max(request.max_output_tokens, 1) - 1
        max_num_blocks = self.kv_cache_manager.num_blocks_for_tokens(max_num_tokens)
        if max_num_blocks > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"max_tokens: request {request.request_id!r} may need {max_num_blocks} KV blocks "
                f"({max_num_tokens} tokens) but the pool has {self.kv_cache_manager.num_blocks}; "
                "lower max_tokens or the prompt length, or add KV blocks"
            )
        self._requests[request.request_id] = request
        self._arrival_index[request.request_id] = self._num_arrivals
        self._num_arrivals += 1
        request.arrival_step = self.num_steps
        if request.deadline is not None:
            self._deadlines[request.request_id] = request.deadline
        self._insert_waiting(request)
        _count(self._num_waiting_by_group, request.group_id, +1)

    # ------------------------------------------------------------------ schedule

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's work; allocate its KV blocks; preempt if the pool runs short.

        The returned output is safe to use until `update_from_output()` is called with it.
        """
        # Invariant: each request's num_computed_tokens catches up with its num_tokens
        # (prompt + output) within the step's token budget. There is no prefill phase: a decode
        # is a request one token behind, a new prompt or a resumed (preempted) request is many
        # tokens behind and is computed in chunks of at most the remaining budget. A request
        # samples only in the step that brings it fully up to date.
        now = time.monotonic() if now is None else now
        self.num_steps += 1
        timed_out = self._expire(now)
        if self.by_priority:  # aging moves effective priorities: restore the queue's order
            self.waiting = deque(sorted(self.waiting, key=self._priority_key))
        if self.policy == "static" and not self._batch_request_ids:
            self._start_batch()
        budget = self.max_num_batched_tokens
        by_running: list[ScheduledRequest | None] = []  # by_running[i]: running[i]'s work (None: none this step)
        preempted: list[Request] = []  # for lack of KV blocks

        # 0. Fair share: with every slot taken, a group running two or more sequences fewer
        #    than the largest group takes one slot from it.
        rebalanced = self._rebalance()

        # 1. Running requests, in admission order. One that cannot get blocks preempts the most
        #    recently arrived running request of the largest group (taking back its work if
        #    already scheduled).
        #    While any request decodes, prompt chunks also share `prefill_budget` (see
        #    _chunk_len), so a long prompt cannot stall the decodes beside it.
        prefill = PrefillBudget(self.prefill_budget if self._any_decoding() else None, self.context_cost)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = prefill.chunk_len(request, budget)
            if num_new_tokens == 0:  # a prompt chunk that must wait for the next step
                index += 1
                by_running.append(None)
                continue
            while not self.kv_cache_manager.can_allocate(request, num_new_tokens):
                victim = max(self.running, key=self._victim_key)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim_index < index:
                    undone = by_running.pop(victim_index)
                    if undone is not None:
                        assert undone.new_request is None  # admitted in an earlier step
                        budget += undone.num_tokens
                        prefill.give_back(undone)
                    index -= 1
                elif victim is request:
                    break
            else:  # no break: the blocks are there
                by_running.append(self._schedule_request(request, num_new_tokens, now))
                prefill.spend(request, num_new_tokens)
                budget -= num_new_tokens
                index += 1
        scheduled = [item for item in by_running if item is not None]

        # 2. Waiting requests, in priority order (fair share within it), while budget, slots
        #    and blocks allow. None in a step that had to preempt for blocks: the pool is short.
        #    By priority: a request that finds no slot or blocks preempts the worst running one
        #    if that is strictly worse (taking back its work if scheduled), even after step 1
        #    preempted. Terminates: every such preemption swaps a running request for a strictly
        #    better one.
        outranked: list[Request] = []  # preempted for a better priority
        while (self.by_priority or not preempted) and budget > 0:
            request = self._next_waiting()
            if request is None or any(request is r for r in rebalanced + preempted + outranked):
                break  # NOTE: a request preempted this step is not resumed in it
            if preempted and self._effective_priority(request) >= min(map(self._effective_priority, preempted)):
                break  # the pool is short: only a strictly better request may take blocks
            # Prefix cache: the request starts after its longest cached run of full blocks.
            cached_block_ids = self.kv_cache_manager.find_cached_blocks(request)
            request.num_computed_tokens = len(cached_block_ids) * self.kv_cache_manager.block_size
            num_new_tokens = prefill.chunk_len(request, budget)
            if num_new_tokens == 0:
                request.num_computed_tokens = 0  # a waiting request holds no blocks
                break
            if len(self.running) >= self.max_num_seqs or not self.kv_cache_manager.can_allocate(
                    request, num_new_tokens, cached_block_ids):
                request.num_computed_tokens = 0
                victim = self._outranked_victim(request)
                if victim is None:
                    break
                undone = next((item for item in scheduled if item.request_id == victim.request_id), None)
                if undone is not None:
                    assert undone.new_request is None  # admitted in an earlier step
                    scheduled.remove(undone)
                    budget += undone.num_tokens
                    prefill.give_back(undone)
                self._preempt(victim)
                outranked.append(victim)
                continue  # the victim's freed blocks may hold more of this prefix: look again
            self._admit(request, cached_block_ids)
            scheduled.append(self._schedule_request(request, num_new_tokens, now))
            prefill.spend(request, num_new_tokens)
            budget -= num_new_tokens

        scheduled_ids = {s.request_id for s in scheduled}
        self._slot_ids = list(self._slots)
        self._slot_states = [SLOT_EMPTY if request_id is None else SLOT_USEFUL if request_id in scheduled_ids
                             else SLOT_IDLE for request_id in self._slot_ids]
        padding_seq_lens: list[int] = []
        if scheduled and self._padding_lens:
            for request_id in self._padding_lens:
                self._padding_lens[request_id] += 1
            padding_seq_lens = list(self._padding_lens.values())
        finished_request_ids, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_request_ids=[request.request_id for request in rebalanced + preempted + outranked],
            fair_share_preempted_ids=[request.request_id for request in rebalanced],
            finished_request_ids=finished_request_ids,
            timed_out_request_ids=timed_out,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            padding_seq_lens=padding_seq_lens,
        )

    def _expire(self, now: float) -> list[str]:
        """Finish (TIMEOUT) every request whose deadline is at or before `now`; their ids."""
        expired = [request_id for request_id, deadline in self._deadlines.items() if deadline <= now]
        if expired:
            self.finish_requests(expired, FinishReason.TIMEOUT, now)
            logger.debug("deadline passed: %s", expired)
        return expired

    def _outranked_victim(self, request: Request) -> Request | None:
        """By priority: the running request to preempt so that waiting `request` can run (the
        worst one, if strictly worse than `request`), or None."""
        if not self.by_priority or not self.running:
            return None
        victim = max(self.running, key=self._victim_key)
        return victim if self._effective_priority(victim) > self._effective_priority(request) else None

    def _insert_waiting(self, request: Request) -> None:
        """Insert after every request that sorts before it (usually: append at the tail)."""
        key = self._priority_key(request)
        index = len(self.waiting)
        while index > 0 and self._priority_key(self.waiting[index - 1]) > key:
            index -= 1
        self.waiting.insert(index, request)

    def _any_decoding(self) -> bool:
        """Whether a running request is one token behind: it samples this step unless held."""
        return any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)

    def _next_waiting(self) -> Request | None:
        """The waiting request to admit next. Continuous: among those of the head's priority,
        the first of the group running the fewest sequences (ties: queue order). Static: the
        first member of the current batch (new arrivals wait for the next batch)."""
        if self.policy == "static":
            return next((r for r in self.waiting if r.request_id in self._batch_request_ids and _ready(r)), None)
        # NOTE: a request whose grammar is still compiling is passed over (a few at most: a
        # compile takes milliseconds), so a slow compile holds back only its own request.
        head = next((r for r in self.waiting if _ready(r)), None)
        if head is None:
            return None
        best = head
        seen: set[str] = set()
        # NOTE: only a group's first waiting request can win, so the scan stops once it has
        # seen every waiting group (one client's thousands of sequences cost one look).
        for request in self.waiting:
            if self._num_running(best) == 0 or len(seen) == len(self._num_waiting_by_group):
                break
            if (request.group_id in seen or self._effective_priority(request) != self._effective_priority(head)
                    or not _ready(request)):
                continue
            seen.add(request.group_id)
            if self._num_running(request) < self._num_running(best):
                best = request
        return best

    def _rebalance(self) -> list[Request]:
        """Fair share, continuous policy: when every slot is taken, the request `_next_waiting`
        would admit takes a slot from the largest running group if that group runs at least two
        sequences more than the request's own (so the move never just swaps the two). Only
        within one priority: the victim goes to the queue's head, and a victim of another
        priority would make its own priority the one admitted next. Preempts at most one
        sequence per step; returns it (or nothing)."""
        if self.policy != "continuous" or len(self.running) < self.max_num_seqs:
            return []
        request = self._next_waiting()
        if request is None:
            return []
        victim = max(self.running, key=self._victim_key)
        if (self._effective_priority(victim) != self._effective_priority(request)
                or self._num_running(victim) < self._num_running(request) + 2):
            return []
        self._preempt(victim)
        return [victim]

    def _start_batch(self) -> None:
        """Static policy: reserve slots for up to `max_num_seqs` waiting requests, the batch."""
        for request in list(self.waiting)[: self.max_num_seqs]:
            self._batch_request_ids.add(request.request_id)
            self._assign_slot(request.request_id)

    def _admit(self, request: Request, cached_block_ids: list[int]) -> None:
        self.kv_cache_manager.take_cached_blocks(request, cached_block_ids)
        if request.first_scheduled_time is None:
            request.num_cached_tokens = request.num_computed_tokens
            self.num_prefix_cache_queries_total += request.num_prompt_tokens
            self.num_prefix_cache_hits_total += request.num_cached_tokens
        self.waiting.remove(request)
        _count(self._num_waiting_by_group, request.group_id, -1)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        _count(self._num_running_by_group, request.group_id, +1)
        if self.policy == "continuous":
            self._assign_slot(request.request_id)
        assert request.request_id in self._slot_by_request_id, f"{request.request_id!r} has no slot"

    def _schedule_request(self, request: Request, num_new_tokens: int, now: float) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        assert 0 < num_new_tokens and end <= request.num_tokens, (request.request_id, start, end)
        block_ids = self.kv_cache_manager.allocate(request, num_new_tokens)
        new_request = None
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            new_request = NewRequestData(request.request_id, list(request.prompt_token_ids), request.params)
        num_prompt = request.num_prompt_tokens
        # Slice prompt and output separately: building all_token_ids would copy the whole sequence.
        token_ids = request.prompt_token_ids[start:end] + request.output_token_ids[
            max(start - num_prompt, 0) : max(end - num_prompt, 0)
        ]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=block_ids,
            sample=end == request.num_tokens,
            new_request=new_request,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the request's K/V and send it to the head of the queue."""
        self._leave_running(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.policy == "continuous":
            self._release_slot(request.request_id)
        if self.by_priority:  # back to its place: it keeps its priority and arrival order
            self._insert_waiting(request)
        else:
            self.waiting.appendleft(request)
        _count(self._num_waiting_by_group, request.group_id, +1)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    # -------------------------------------------------------------- results in

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, now: float | None = None
    ) -> list[Request]:
        """Apply one step's results: advance computed tokens, append sampled tokens, finish
        requests that stop (freeing their blocks and, under the continuous policy, their slots
        for the very next step).

        Returns the requests that changed: got a token and/or finished, in schedule order.
        Requests aborted since `schedule()` are skipped. A request whose grammar rejects its
        token ends without it: not among them, but in `constraint_failed_request_ids`.
        """
        now = time.monotonic() if now is None else now
        # The runner samples for the scheduled requests that sample, in schedule order.
        sampled_ids, sampled_tokens = runner_output.request_ids, runner_output.sampled_token_ids
        assert len(sampled_tokens) == len(sampled_ids)
        num_sampled, token_id = 0, -1
        self.constraint_failed_request_ids = []
        changed: list[Request] = []
        for scheduled in scheduler_output.scheduled:
            if scheduled.sample:
                assert num_sampled < len(sampled_ids) and sampled_ids[num_sampled] == scheduled.request_id, (
                    f"runner sampled for {sampled_ids}, expected {scheduled.request_id!r} at {num_sampled}")
                token_id = sampled_tokens[num_sampled]
                num_sampled += 1
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or otherwise finished) after this output was scheduled
            request.num_computed_tokens += scheduled.num_tokens
            self.kv_cache_manager.cache_computed_blocks(request)  # the step wrote these blocks' K/V
            if not scheduled.sample:
                continue
            if request.grammar is not None and not request.grammar.accept(token_id):
                # The mask allowed it, yet the grammar engine took it back: it gave up (a limit
                # of its own, an unsatisfiable schema) or no allowed token was left to sample.
                # The token is not the output's: the sequence ends with the tokens its
                # constraint accepted (constraint_failed_request_ids: ended with no token).
                logger.warning("request %s: the output constraint failed at token %d: %s", request.request_id,
                               token_id, request.grammar.failure or "no token it allows could be sampled")
                request.finish_reason = FinishReason.CONSTRAINT
                self._leave_running(request)
                self._finish(request, now)
                self.constraint_failed_request_ids.append(request.request_id)
                continue
            request.append_output_token(token_id, now)
            changed.append(request)
            if request.check_stop():
                self._leave_running(request)
                self._finish(request, now)
        assert num_sampled == len(sampled_ids), f"runner sampled for {sampled_ids}, {num_sampled} expected"
        return changed

    def finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, now: float | None = None
    ) -> list[Request]:
        """Finish requests at once (abort, or a stop string the detokenizer found), waiting or
        running; their blocks are free immediately. Unknown or finished ids are ignored.

        Returns the requests finished by this call.
        """
        now = time.monotonic() if now is None else now
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished: list[Request] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self._leave_running(request)
            else:
                self.waiting.remove(request)
                _count(self._num_waiting_by_group, request.group_id, -1)
            request.finish_reason = reason
            self._finish(request, now)
            finished.append(request)
        return finished

    def _finish(self, request: Request, now: float) -> None:
        """Retire a request already removed from its queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_time = now
        del self._requests[request.request_id]
        del self._arrival_index[request.request_id]
        self._deadlines.pop(request.request_id, None)
        self._finished_request_ids.append(request.request_id)
        if self.policy == "continuous":
            self._release_slot(request.request_id)
        elif request.request_id in self._batch_request_ids:
            self._batch_request_ids.discard(request.request_id)
            if not self._batch_request_ids:  # the batch is over: all its slots come free
                for request_id in list(self._slot_by_request_id):
                    self._release_slot(request_id)
                self._padding_lens.clear()
            elif self.config.static_padding:
                # Its row keeps running: the next step feeds its last token (position
                # num_tokens - 1), the one after position num_tokens, and so on.
                self._padding_lens[request.request_id] = request.num_tokens - 1

    # --------------------------------------------------------------- helpers

    def _effective_priority(self, request: Request) -> int:
        """`priority`, improved by aging under the priority policy (lower runs first)."""
        if not self.by_priority:
            return request.priority
        return request.priority - (self.num_steps - request.arrival_step) // self.priority_aging_steps

    def _priority_key(self, request: Request) -> tuple[int, float, int]:
        """Sort key of the waiting queue: lower runs first."""
        return (self._effective_priority(request), request.arrival_time, self._arrival_index[request.request_id])

    def _victim_key(self, request: Request) -> tuple[int, int, float, int]:
        """The running request with the maximum is preempted first: the worst priority, then
        the group running the most sequences, then the most recent arrival."""
        return (self._effective_priority(request), self._num_running(request), request.arrival_time,
                self._arrival_index[request.request_id])

    def _num_running(self, request: Request) -> int:
        """How many sequences of the request's group are running."""
        return self._num_running_by_group.get(request.group_id, 0)

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        _count(self._num_running_by_group, request.group_id, -1)

    def _assign_slot(self, request_id: str) -> None:
        slot = self._slots.index(None)  # ValueError here means more requests than slots: a bug
        self._slots[slot] = request_id
        self._slot_by_request_id[request_id] = slot

    def _release_slot(self, request_id: str) -> None:
        slot = self._slot_by_request_id.pop(request_id, None)
        if slot is not None:
            self._slots[slot] = None


def _ready(request: Request) -> bool:
    """Whether a waiting request may be admitted: unconstrained, or its grammar is compiled."""
    return request.grammar is None or bool(request.grammar.ready)


def _count(counts: dict[str, int], key: str, delta: int) -> None:
    """Add `delta` to `counts[key]`, dropping the key at zero (so `len(counts)` counts keys in use)."""
    value = counts.get(key, 0) + delta
    assert value >= 0, (key, value)
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)
