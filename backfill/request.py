"""Request: one sequence the engine generates, owned by the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backfill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backfill.core.outputs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV blocks freed; recomputed later
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled by the client or the engine
    TIMEOUT = "timeout"  # its deadline passed first (the server answers with an error, not a choice)
    # its output constraint (structured output) left no token the grammar engine could take, or
    # failed within the engine's limits (the server answers with an error, not a choice)
    CONSTRAINT = "constraint"


@dataclass
class Request:
    """One sequence: prompt, generated tokens and progress.

    Invariant: `num_computed_tokens <= num_tokens`. Each step the scheduler lets computed tokens
    catch up with total tokens (prompt chunks and decodes alike); a request samples a new token
    in a step only when that step brings it fully up to date.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2**31
    priority: int = 0  # lower runs first; ties by arrival
    # The client request this sequence belongs to (its n samples, its batch of prompts): the
    # scheduler shares batch slots fairly between groups. Empty: a group of its own.
    group_id: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which the scheduler ends it (TIMEOUT)
    arrival_step: int = 0  # the scheduler's step count when it was added (set by the scheduler)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Constrained decoding (backfill.structured_output.Grammar: `ready`, `error`, `accept(token)`,
    # `terminated`); None: unconstrained. Not admitted before it is ready.
    grammar: Any = None
    # The prompt's logprobs so far, from its token 1 on (`params.prompt_logprobs` set; else None).
    prompt_logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if not self.group_id:
            self.group_id = self.request_id
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_output_tokens(self) -> int:
        """Most tokens this request may generate: max_tokens capped by the context length."""
        room = self.max_model_len - self.num_prompt_tokens
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def check_stop(self) -> bool:
        """Set the finish reason if the last generated token ends the request.

        Stop strings are checked by the detokenizer, which sees text; this checks tokens.
        """
        if not self.output_token_ids:
            return False
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if last in self.params.stop_token_id_set:
                self.finish_reason, self.stop_reason = FinishReason.STOP, last
                return True
        if self.grammar is not None and self.grammar.terminated:  # the output is complete
            self.finish_reason, self.stop_reason = FinishReason.STOP, None
            return True
        if self.num_output_tokens >= self.max_output_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
