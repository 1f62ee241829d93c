"""LLMEngine: the synchronous core loop (schedule, run, sample, detokenize, stop)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from backfill.config import EngineConfig
from backfill.core.outputs import ModelRunnerOutput, SchedulerOutput, StepStats, TokenLogprobs
from backfill.core.scheduler import Scheduler
from backfill.engine.detokenizer import IncrementalDetokenizer
from backfill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from backfill.request import FinishReason, Request
from backfill.sampling_params import SamplingParams
from backfill.tokenizer import Tokenizer, load_tokenizer
from backfill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class _Sequence:
    """Engine-side view of one of the n sequences of a request: its text and what was sent."""

    group_id: str
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    num_detokenized: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    done: bool = False


@dataclass
class _Group:
    """A user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.done for seq in self.sequences)

    def metrics(self) -> RequestMetrics:
        requests = [seq.request for seq in self.sequences]
        first_scheduled = [r.first_scheduled_time for r in requests if r.first_scheduled_time is not None]
        first_token = [r.first_token_time for r in requests if r.first_token_time is not None]
        last_token = [r.token_times[-1] for r in requests if r.token_times]
        finish = [r.finish_time for r in requests if r.finish_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(first_scheduled, default=None),
            first_token_time=min(first_token, default=None),
            last_token_time=max(last_token, default=None),
            finish_time=max(finish) if self.finished and finish else None,
            num_preemptions=sum(r.num_preemptions for r in requests),
        )


class LLMEngine:
    """The synchronous engine: one `step()` is one iteration of continuous batching.

    Single-threaded and not thread-safe: the async server drives it from one thread. Every test
    can drive it step by step.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self.max_model_len = self.runner.max_model_len
        self.model_name = _model_name(config.model)
        self.scheduler = Scheduler(config, self.runner.num_kv_blocks, config.resolved_prefill_budget(),
                                   self.runner.context_cost)
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, _Sequence] = {}  # by the scheduler's request id
        self._num_steps = 0
        self.last_step_stats: StepStats | None = None
        self.vocab_size = self.runner.model_config.vocab_size
        self._eos_token_ids = tuple(
            dict.fromkeys(self.runner.model_config.eos_token_ids + self.tokenizer.eos_token_ids)
        )

    # ---- requests in -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
    ) -> None:
        """Queue a request. Raises `ValueError("<field>: ...")` for input the engine can't serve.

        `group_id` names the client request it belongs to (the server gives every prompt of one
        HTTP request the same): the scheduler shares slots fairly between groups. Default: the
        request is a group of its own, its n sequences included.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        prompt_text, prompt_token_ids = self._encode_prompt(prompt)
        self._check_lengths(prompt_token_ids, params)
        for token_id in params.logit_bias or {}:
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        group = _Group(request_id, prompt_text, prompt_token_ids, arrival_time or time.monotonic())
        for index in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                seq_params = replace(params, seed=params.seed + index)
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(
                request_id=seq_id,
                prompt_token_ids=list(prompt_token_ids),
                params=seq_params,
                eos_token_ids=self._eos_token_ids,
                max_model_len=self.max_model_len,
                priority=priority,
                arrival_time=group.arrival_time,
                group_id=group_id or request_id,
            )
            detokenizer = IncrementalDetokenizer(self.tokenizer.hf, prompt_token_ids, seq_params)
            logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
            group.sequences.append(_Sequence(request_id, request, index, detokenizer, logprobs))
        if any(seq.request.request_id in self._sequences for seq in group.sequences):
            raise ValueError(f"request_id: {request_id!r} collides with a running request's sequence id")
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
            self._sequences[seq.request.request_id] = seq
        self._groups[request_id] = group

    def _encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not token_ids:
                raise ValueError("prompt: encodes to no tokens")
            return prompt, token_ids
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: must be a non-empty string or list of token ids")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"prompt: token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"prompt: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return None, list(prompt)

    def _check_lengths(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, "
                f"and the prompt has {num_prompt} tokens (at least one must be left to generate)"
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + params.max_tokens} tokens "
                f"({num_prompt} in the prompt, {params.max_tokens} for the completion)"
            )
        # NOTE: min_tokens holds off EOS; past the room left it would run to the full context.
        room = self.max_model_len - num_prompt
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                f"the {num_prompt}-token prompt leaves room for {room}, fewer than min_tokens "
                f"({params.min_tokens})"
            )

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Cancel requests; their KV blocks are free before the next step. Unknown ids are ignored."""
        for request_id in list(request_ids):
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            self.scheduler.finish_requests([seq.request.request_id for seq in group.sequences], FinishReason.ABORT)
            self._forget(group)

    # ---- the loop ----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, detokenize, check stops."""
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        slot_states = self.scheduler.slot_states()
        runner_output = self.runner.execute(scheduler_output)
        now = time.monotonic()
        changed = self.scheduler.update_from_output(scheduler_output, runner_output, now)
        outputs = self._process(changed, runner_output)
        self._record_stats(start, scheduler_output, slot_states)
        return outputs

    def _process(self, changed: list[Request], runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        logprobs_by_id: dict[str, TokenLogprobs | None] = {}
        if runner_output.logprobs is not None:
            logprobs_by_id = dict(zip(runner_output.request_ids, runner_output.logprobs))
        touched: dict[str, list[_Sequence]] = {}
        for request in changed:
            seq = self._sequences.get(request.request_id)
            if seq is None:  # aborted since it was scheduled
                continue
            self._advance(seq, logprobs_by_id.get(request.request_id))
            touched.setdefault(seq.group_id, []).append(seq)
        outputs = []
        for group_id, seqs in touched.items():
            group = self._groups[group_id]
            outputs.append(self._make_output(group, seqs))
            if group.finished:
                self._forget(group)
        return outputs

    def _advance(self, seq: _Sequence, logprobs: TokenLogprobs | None) -> None:
        """Feed a sequence's new tokens to its detokenizer and apply stop strings."""
        request = seq.request
        new_token_ids = request.output_token_ids[seq.num_detokenized :]
        seq.num_detokenized = request.num_output_tokens
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        stop = seq.detokenizer.add_tokens(new_token_ids) if new_token_ids else None
        if stop is not None:
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], FinishReason.STOP)
            # A stop string wins over a length stop reached by the same token: the text was cut.
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        elif request.is_finished:
            seq.detokenizer.flush()
            if seq.detokenizer.stop_str is not None:  # held-back text completed a stop string
                request.finish_reason, request.stop_reason = FinishReason.STOP, seq.detokenizer.stop_str
        seq.done = request.is_finished

    def _make_output(self, group: _Group, seqs: list[_Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            request = seq.request
            token_ids = list(request.output_token_ids)
            delta_logprobs = None
            if seq.logprobs is not None:
                delta_logprobs = seq.logprobs[seq.num_sent_logprobs :]
                seq.num_sent_logprobs = len(seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text,
                    token_ids=token_ids,
                    finish_reason=request.finish_reason.value if request.finish_reason else None,
                    stop_reason=request.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    delta_text=seq.detokenizer.get_delta(),
                    delta_token_ids=token_ids[seq.num_sent_tokens :],
                    delta_logprobs=delta_logprobs,
                )
            )
            seq.num_sent_tokens = len(token_ids)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=group.metrics(),
        )

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.sequences:
            self._sequences.pop(seq.request.request_id, None)

    def _record_stats(self, start: float, scheduler_output: SchedulerOutput, slot_states: list[tuple[str | None, str]]) -> None:
        self._num_steps += 1
        num_decode = sum(1 for item in scheduler_output.scheduled if item.num_tokens == 1)
        kv = self.scheduler.kv_cache_manager
        self.last_step_stats = StepStats(
            step=self._num_steps,
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
            num_slots_useful=sum(1 for _, state in slot_states if state == "useful"),
            num_slots_idle=sum(1 for _, state in slot_states if state == "idle"),
            num_padding_tokens=len(scheduler_output.padding_seq_lens),
            slot_request_ids=[request_id for request_id, _ in slot_states],
            slot_states=[state for _, state in slot_states],
        )

    # ---- state for metrics -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_kv_blocks_used(self) -> int:
        return self.scheduler.kv_cache_manager.num_used_blocks

    @property
    def num_kv_blocks_total(self) -> int:
        return self.scheduler.kv_cache_manager.num_blocks

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total


def _model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
