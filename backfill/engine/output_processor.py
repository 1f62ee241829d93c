"""OutputProcessor: the core's token ids -> what users read (front end side).

Owns the text side of every request in flight: one `IncrementalDetokenizer` per sequence
(UTF-8 and stop-string holds), the logprobs gathered so far, the times the request's tokens
arrived, and the fan-in of an n > 1 request's sequences into one `RequestOutput`. A stop string
ends a sequence here, and `process()` hands back the ids the core must abort.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from backfill.core.outputs import TokenLogprobs
from backfill.engine.detokenizer import IncrementalDetokenizer
from backfill.engine.messages import EngineCoreOutput
from backfill.engine.processor import ProcessedRequest
from backfill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from backfill.request import FinishReason

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """Front-end view of one of the n sequences of a request: its text and what was sent."""

    group_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    first_token_steps: int | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Group:
    """A user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    sequences: list[_Sequence]
    core_ids: list[str]  # the core's ids of its sequences, in index order
    finish_time: float | None = None
    # Once a sequence has them (each of the n computes them: a stream's first output of any of
    # them must find them here).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(seq.done for seq in self.sequences)

    def metrics(self) -> RequestMetrics:
        seqs = self.sequences
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None),
                                     default=None),
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None),
            last_token_time=max((s.last_token_time for s in seqs if s.last_token_time is not None), default=None),
            finish_time=self.finish_time,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            first_token_steps=min((s.first_token_steps for s in seqs if s.first_token_steps is not None),
                                  default=None),
        )


class OutputProcessor:
    """Not thread-safe: the server calls it on its event loop, `LLMEngine` on its caller's thread."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, _Sequence] = {}  # by the core's request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, request: ProcessedRequest) -> None:
        if request.request_id in self._groups:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if any(seq.request_id in self._sequences for seq in request.sequences):
            raise ValueError(f"request_id: {request.request_id!r} collides with a running request's sequence id")
        sequences = []
        for index, core_request in enumerate(request.sequences):
            detokenizer = IncrementalDetokenizer(self._hf_tokenizer, request.prompt_token_ids, core_request.params)
            seq = _Sequence(request.request_id, index, detokenizer, [] if request.params.logprobs is not None else None)
            sequences.append(seq)
            self._sequences[core_request.request_id] = seq
        self._groups[request.request_id] = _Group(request.request_id, request.prompt, request.prompt_token_ids,
                                                  request.arrival_time, sequences,
                                                  [core_request.request_id for core_request in request.sequences])

    def request_of(self, core_id: str) -> str | None:
        """The request a sequence of the core belongs to (None once it is forgotten)."""
        seq = self._sequences.get(core_id)
        return seq.group_id if seq is not None else None

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the core ids of its sequences (to abort there)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        return self._forget(group)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs: returns the requests' outputs (one per request that changed)
        and the core ids of sequences that a stop string ended (the core must abort them)."""
        to_abort: list[str] = []
        touched: dict[str, list[_Sequence]] = {}
        for output in outputs:
            seq = self._sequences.get(output.request_id)
            # None: aborted since the step began. Finished: a stop string ended it here while the
            # core, not yet told (the abort is on its way), ran it further: those tokens are not
            # part of its output.
            if seq is None or seq.finish_reason is not None:
                continue
            try:
                if self._advance(seq, output):
                    to_abort.append(output.request_id)
            except Exception:  # noqa: BLE001 - a defect hit by one sequence must not cost the others their output
                logger.exception("request %s: a step's output could not be applied; the sequence ends (abort)",
                                 seq.group_id)
                seq.finish_reason, seq.stop_reason = FinishReason.ABORT.value, None
                to_abort.append(output.request_id)
            if output.prompt_logprobs is not None:  # the first token has none: nothing predicts it
                self._groups[seq.group_id].prompt_logprobs = [None, *output.prompt_logprobs]
            touched.setdefault(seq.group_id, []).append(seq)
        request_outputs = []
        for group_id, seqs in touched.items():
            group = self._groups[group_id]
            if group.finished:
                group.finish_time = max(seq.last_token_time or group.arrival_time for seq in group.sequences)
            request_outputs.append(self._make_output(group, seqs))
            if group.finished:
                del self._groups[group_id]
                self._forget(group)
        return request_outputs, to_abort

    def _advance(self, seq: _Sequence, output: EngineCoreOutput) -> bool:
        """Feed a sequence its new tokens; True if a stop string ended it before the core did."""
        if seq.first_token_time is None and output.new_token_ids:
            seq.first_token_time = output.token_time
        seq.last_token_time = output.token_time
        seq.first_scheduled_time = output.first_scheduled_time
        seq.num_preemptions = output.num_preemptions
        if output.num_cached_tokens is not None:
            seq.num_cached_tokens = output.num_cached_tokens
        if output.first_token_steps is not None:
            seq.first_token_steps = output.first_token_steps
        seq.token_ids.extend(output.new_token_ids)
        if seq.logprobs is not None and output.new_logprobs:
            seq.logprobs.extend(output.new_logprobs)
        text_ids = output.new_token_ids
        if (output.stop_token_id is not None and text_ids and text_ids[-1] == output.stop_token_id
                and not seq.detokenizer.include_stop):
            text_ids = text_ids[:-1]  # a stop token's (or EOS's) text is left out, as vLLM does
        stop = seq.detokenizer.add_tokens(text_ids) if text_ids else None
        if stop is not None:
            # A stop string wins over a stop reached by the same token: the text was cut.
            seq.finish_reason, seq.stop_reason = FinishReason.STOP.value, stop
            return output.finish_reason is None
        if output.finish_reason is not None:
            seq.detokenizer.flush()
            if seq.detokenizer.stop_str is not None:  # held-back text completed a stop string
                seq.finish_reason, seq.stop_reason = FinishReason.STOP.value, seq.detokenizer.stop_str
            else:
                seq.finish_reason, seq.stop_reason = output.finish_reason, output.stop_token_id
        return False

    def _make_output(self, group: _Group, seqs: list[_Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            token_ids = list(seq.token_ids)
            delta_logprobs = None
            if seq.logprobs is not None:
                delta_logprobs = seq.logprobs[seq.num_sent_logprobs :]
                seq.num_sent_logprobs = len(seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text,
                    token_ids=token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
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
            num_cached_tokens=max(seq.num_cached_tokens for seq in group.sequences),
            prompt_logprobs=group.prompt_logprobs,
        )

    def _forget(self, group: _Group) -> list[str]:
        for core_id in group.core_ids:
            self._sequences.pop(core_id, None)
        return group.core_ids
