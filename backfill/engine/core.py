"""EngineCore: the scheduler and the model runner, one step at a time; plain data in and out.

Everything text-shaped (tokenizing, detokenizing, stop strings, n > 1 groups) is the front
end's (`processor.py`, `output_processor.py`). The core sees token ids: it schedules, runs the
model, samples, and applies the stop-token and length checks, all inside the `Scheduler`,
which alone changes a `Request`. The offline `LLMEngine` calls it in-process; the server runs
it in a process of its own (`core_process.py`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from backfill.config import EngineConfig
from backfill.core.outputs import ModelRunnerOutput, SchedulerOutput, StepStats
from backfill.core.scheduler import SLOT_IDLE, SLOT_USEFUL, Scheduler
from backfill.engine.messages import CoreInfo, CoreLoad, EngineCoreOutput, EngineCoreRequest
from backfill.request import FinishReason, Request
from backfill.structured_output.manager import Grammar, GrammarBitmask, StructuredOutputManager, log_line
from backfill.tokenizer import load_tokenizer
from backfill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# With nothing to run but requests whose grammar compiles, a step waits this long for a compile
# (new inputs wait at most this long too) instead of spinning.
COMPILE_WAIT_S = 0.005


class EngineCore:
    """Synchronous and single-threaded: `step()` is one iteration of continuous batching."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner.num_kv_blocks, config.resolved_prefill_budget(),
                                   self.runner.context_cost)
        self.info = CoreInfo(
            model_name=model_name(config.model),
            max_model_len=self.runner.max_model_len,
            vocab_size=self.runner.model_config.vocab_size,
            eos_token_ids=tuple(self.runner.model_config.eos_token_ids),
            max_num_seqs=config.max_num_seqs,
            num_kv_blocks=self.runner.num_kv_blocks,
            scheduling_policy=config.scheduling_policy,
            block_size=self.runner.block_size,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self._prefix_cache_seen = (0, 0)  # the scheduler's (queries, hits) totals at the last step
        self.structured_output = StructuredOutputManager(lambda: load_tokenizer(config.model),
                                                         self.info.vocab_size)
        self._grammars: dict[str, Grammar] = {}  # constrained sequences not yet finished
        self._compiling: dict[str, Grammar] = {}  # ... whose grammar is not compiled yet

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a sequence the front end validated (ids in the vocabulary, lengths that fit).
        Without a deadline of its own it gets `config.request_timeout` after its arrival."""
        if self.scheduler.get_request(request.request_id) is not None:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        deadline = request.deadline
        if deadline is None and self.config.request_timeout is not None:
            deadline = request.arrival_time + self.config.request_timeout
        grammar = None
        if request.params.structured_outputs is not None:  # compiles in the background
            grammar = self.structured_output.grammar(request.params.structured_outputs)
            self._grammars[request.request_id] = self._compiling[request.request_id] = grammar
        self.scheduler.add_request(Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=request.params,
            eos_token_ids=request.eos_token_ids,
            max_model_len=self.info.max_model_len,
            priority=request.priority,
            arrival_time=request.arrival_time,
            group_id=request.group_id,
            deadline=deadline,
            grammar=grammar,
        ))

    def abort(self, request_ids: Iterable[str]) -> None:
        """End sequences now; their KV blocks are free before the next step. Unknown ids are
        ignored (a sequence may have finished on its own meanwhile)."""
        self.scheduler.finish_requests(list(request_ids), FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[EngineCoreOutput], StepStats]:
        """Schedule, run the model, sample, apply stops. One output per sequence that got a
        token this step (a prompt's chunks before its last give none)."""
        start = time.monotonic()
        failed = self._poll_grammars()
        scheduler_output = self.scheduler.schedule()
        slot_ids, slot_states = self.scheduler.last_slots()
        if scheduler_output.is_empty and self._compiling:
            next(iter(self._compiling.values())).wait(COMPILE_WAIT_S)
        runner_output = self.runner.execute(scheduler_output, self._grammar_bitmask(scheduler_output))
        now = time.monotonic()
        self._gather_prompt_logprobs(runner_output)
        changed = self.scheduler.update_from_output(scheduler_output, runner_output, now)
        outputs = _ended(scheduler_output.timed_out_request_ids, FinishReason.TIMEOUT, now)
        outputs += _ended(failed + self.scheduler.constraint_failed_request_ids, FinishReason.CONSTRAINT, now)
        outputs += _outputs(changed, runner_output, now, self.scheduler.num_steps)
        if self._grammars:
            for request_id in [r for r in self._grammars if self.scheduler.get_request(r) is None]:
                del self._grammars[request_id]
        return outputs, self._stats(start, scheduler_output, slot_ids, slot_states)

    def _gather_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        """Append each request's new prompt logprobs. A preempted request computes its prompt
        again: the positions it already has are skipped."""
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            request = self.scheduler.get_request(request_id)
            if request is not None and request.prompt_logprobs is not None:
                have = 1 + len(request.prompt_logprobs)  # the prompt position of the next entry
                if first <= have:
                    request.prompt_logprobs.extend(entries[have - first:])

    def _poll_grammars(self) -> list[str]:
        """Mark finished compiles; end (ABORT) the sequences whose grammar failed to compile.
        The front ends check grammars before queuing them, so this is a last resort."""
        if not self._compiling:
            return []
        failed = []
        for request_id, grammar in list(self._compiling.items()):
            if grammar.poll():
                del self._compiling[request_id]
                if grammar.error is not None:
                    logger.error("request %s: %s", request_id, log_line(grammar.error))
                    failed.append(request_id)
        self.scheduler.finish_requests(failed, FinishReason.CONSTRAINT)
        return failed

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The allowed tokens of the constrained sequences that sample this step."""
        if not self._grammars:
            return None
        rows = [(item.request_id, grammar) for item in scheduler_output.scheduled
                if item.sample and (grammar := self._grammars.get(item.request_id)) is not None]
        return self.structured_output.bitmask(rows)

    def load(self) -> CoreLoad:
        kv = self.scheduler.kv_cache_manager
        return CoreLoad(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_steps=self.scheduler.num_steps,
            num_kv_blocks_cached_free=kv.num_cached_free_blocks,
        )

    def _stats(self, start: float, scheduler_output: SchedulerOutput, slot_ids: list[str | None],
               slot_states: list[str]) -> StepStats:
        num_decode = sum(1 for item in scheduler_output.scheduled if item.num_tokens == 1)
        kv = self.scheduler.kv_cache_manager
        queries, hits = self.scheduler.num_prefix_cache_queries_total, self.scheduler.num_prefix_cache_hits_total
        seen_queries, seen_hits = self._prefix_cache_seen
        self._prefix_cache_seen = (queries, hits)
        return StepStats(
            step=self.scheduler.num_steps,  # one schedule() a step: this step's number
            start_time=start,
            duration=time.monotonic() - start,
            num_batched_tokens=scheduler_output.num_batched_tokens,
            num_prefill_tokens=scheduler_output.num_batched_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks,
            num_preempted=len(scheduler_output.preempted_request_ids),
            num_slots=self.config.max_num_seqs,
            num_slots_useful=slot_states.count(SLOT_USEFUL),
            num_slots_idle=slot_states.count(SLOT_IDLE),
            num_padding_tokens=len(scheduler_output.padding_seq_lens),
            slot_request_ids=slot_ids,
            slot_states=slot_states,
            num_prefix_cache_queries=queries - seen_queries,
            num_prefix_cache_hits=hits - seen_hits,
            num_kv_blocks_cached_free=kv.num_cached_free_blocks,
        )


def _ended(request_ids: list[str], reason: FinishReason, now: float) -> list[EngineCoreOutput]:
    """The ends of sequences the core finished with no token: "timeout" (the deadline passed)
    or "constraint" (the grammar failed to compile, or rejected the token sampled)."""
    return [EngineCoreOutput(request_id=request_id, new_token_ids=[], token_time=now,
                             finish_reason=reason.value) for request_id in request_ids]


def _outputs(changed: list[Request], runner_output: ModelRunnerOutput, now: float,
             num_steps: int) -> list[EngineCoreOutput]:
    """Plain outputs of the requests a step changed (each got exactly one token); `num_steps`:
    the scheduler's step count, this step included."""
    logprobs_by_id = {}
    if runner_output.logprobs is not None:
        logprobs_by_id = dict(zip(runner_output.request_ids, runner_output.logprobs))
    outputs = []
    for request in changed:
        logprobs = logprobs_by_id.get(request.request_id)
        reason = request.finish_reason
        outputs.append(EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=request.output_token_ids[-1:],
            token_time=now,
            first_scheduled_time=request.first_scheduled_time,
            num_preemptions=request.num_preemptions,
            new_logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=reason.value if reason is not None else None,
            stop_token_id=request.stop_reason if isinstance(request.stop_reason, int) else None,
            num_cached_tokens=request.num_cached_tokens if request.num_output_tokens == 1 else None,
            prompt_logprobs=request.prompt_logprobs if request.num_output_tokens == 1 else None,
            first_token_steps=num_steps - request.arrival_step if request.num_output_tokens == 1 else None,
        ))
    return outputs


def model_name(model: str | None) -> str:
    """The id a model is served as: its file or folder name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
