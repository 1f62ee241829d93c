"""Plain-data messages between the scheduler, the model runner and the engine.

Nothing here holds a tensor: the scheduler and the model runner exchange lists of ints, so the
control plane can be tested on CPU with hand-written runner outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backfill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the runner caches for sampling."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work in one step.

    The step computes `token_ids` at positions `num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1`; their K/V are written into `block_ids`, which
    cover at least all of those positions. `sample` is True when this step brings the request's
    computed tokens up to its total, so its last position's logits are sampled.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    new_request: NewRequestData | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # The part of preempted_request_ids that gave a slot to a group with fewer (fair share),
    # rather than KV blocks to a running request; admissions may follow in the same step.
    fair_share_preempted_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step: the runner drops their cached state.
    finished_request_ids: list[str] = field(default_factory=list)
    # The part of finished_request_ids whose deadline passed (finished TIMEOUT by this schedule()).
    timed_out_request_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Static policy with padding: one row per batch slot still held by a finished request. Row
    # i runs a dummy token at position padding_seq_lens[i] - 1 over a context of that many
    # tokens, as the finished sequence's row of a fixed-shape batch would; nothing is sampled.
    padding_seq_lens: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probabilities for one token (generated, or of the prompt): the chosen one and the top
    alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs only)


@dataclass
class ModelRunnerOutput:
    """One sampled token for each scheduled request with `sample=True`, in schedule order."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # None when no request asked for them
    # Prompt logprobs computed this step: request id -> (prompt position of the first, entries).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class StepStats:
    """What one engine step did: the raw data of every metric and plot."""

    step: int
    start_time: float
    duration: float  # seconds of wall time, schedule + model + sampling + bookkeeping
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preempted: int
    num_slots: int  # max_num_seqs
    num_slots_useful: int  # slots whose request advanced this step
    num_slots_idle: int  # slots held by a request that did nothing useful (static: finished, waiting for the batch)
    num_padding_tokens: int = 0  # idle slots computed anyway (static policy with padding)
    slot_request_ids: list[str | None] = field(default_factory=list)  # per slot, for timelines
    slot_states: list[str] = field(default_factory=list)  # per slot: "useful" | "idle" | "empty"
    # Prefix cache, in prompt tokens of the requests first admitted this step: looked up, found
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_kv_blocks_cached_free: int = 0  # free blocks still holding a reusable prefix (not in _used)

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)
