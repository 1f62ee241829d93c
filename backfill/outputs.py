"""User-facing results of generation (the offline API and the server both return these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backfill.core.outputs import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timestamps of one request, from `time.monotonic()`."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    first_token_steps: int | None = None  # engine steps from arrival at the core to the first token


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    `text` and `token_ids` are cumulative; `delta_text` and `delta_token_ids` hold what was
    added since the previous output for this completion (what a stream sends).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: all completions for `LLM.generate`, or the changed ones for a stream."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens whose K/V came from the prefix cache (n > 1: the most any sequence found).
    num_cached_tokens: int = 0
    # `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first (nothing
    # predicts it); set from the request's first output on.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    # Shortcuts to the first completion: what `n == 1` users read.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
