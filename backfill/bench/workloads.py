"""Benchmark workloads: JSON lines of requests, and a seeded generator for the standard cases.

One request a line:
    {"prompt": "...", "max_tokens": 8, "arrival_time": 0.0}
    {"prompt_token_ids": [1, 2, 3], "max_tokens": 300}
`arrival_time` (seconds from the start of the run) is optional; a missing one means "at once".

Nothing here imports torch or the engine: `bench serve` must stay usable against any server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from backfill.bench.text_corpus import INSTRUCTIONS, QUESTIONS, SENTENCES

WorkloadKind = Literal["mixed", "uniform", "long-prompt", "shared-prefix", "multi-turn"]
ArrivalKind = Literal["all-at-once", "poisson", "gamma"]
WORKLOAD_KINDS: tuple[str, ...] = ("mixed", "uniform", "long-prompt", "shared-prefix", "multi-turn")
ARRIVAL_KINDS: tuple[str, ...] = ("all-at-once", "poisson", "gamma")


@dataclass
class WorkloadRequest:
    """One request of a workload. Exactly one of `prompt` / `prompt_token_ids` is set."""

    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    arrival_time: float | None = None  # seconds from the start; None: at once

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("prompt: exactly one of prompt / prompt_token_ids must be given")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError("prompt: must be a non-empty string")
        if self.prompt_token_ids is not None and (
            not self.prompt_token_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prompt_token_ids)
        ):
            raise ValueError("prompt_token_ids: must be a non-empty list of non-negative ints")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if self.arrival_time is not None and (
            not isinstance(self.arrival_time, (int, float)) or not math.isfinite(self.arrival_time)
            or self.arrival_time < 0
        ):
            raise ValueError(f"arrival_time: must be a finite number >= 0, got {self.arrival_time!r}")

    @property
    def arrival_s(self) -> float:
        return float(self.arrival_time or 0.0)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.prompt is not None:
            data["prompt"] = self.prompt
        else:
            data["prompt_token_ids"] = self.prompt_token_ids
        data["max_tokens"] = self.max_tokens
        if self.arrival_time is not None:
            data["arrival_time"] = round(float(self.arrival_time), 6)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadRequest:
        unknown = set(data) - {"prompt", "prompt_token_ids", "max_tokens", "arrival_time"}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        if "max_tokens" not in data:
            raise ValueError("max_tokens: missing")
        return cls(
            max_tokens=data["max_tokens"],
            prompt=data.get("prompt"),
            prompt_token_ids=data.get("prompt_token_ids"),
            arrival_time=data.get("arrival_time"),
        )


@dataclass(frozen=True)
class WorkloadSpec:
    """What `generate_workload` draws. Ranges are inclusive (low, high).

    mixed: round(short_share * num_requests) requests want `short_tokens` output tokens, the
    rest `long_tokens`, shuffled. uniform: every request draws from `uniform_tokens`.
    long-prompt: num_requests - 1 streams drawing from `uniform_tokens` arrive as `arrival`
    says, then one prompt of `long_prompt_words` words (one output token) arrives at
    `long_prompt_arrival` s: what a long prompt does to the streams' inter-token latency.
    Arrivals: all at once (arrival_time 0), Poisson at `request_rate`, or gamma intervals with
    shape `burstiness` (< 1 burstier, > 1 smoother; 1 is Poisson), as `vllm bench serve`.

    The prefix-caching kinds give prompts as token ids (exact lengths without a tokenizer),
    drawn from `token_id_range` (ordinary tokens of the model's vocabulary: the default suits
    vocabularies of 20k+ tokens, the default model's has 49,152). Output lengths draw from
    `uniform_tokens`.
    shared-prefix: every request is one system prompt of `system_prompt_tokens` tokens (one of
    `num_prefixes`, each used by as many requests, in a shuffled order), then a user turn of its
    own of `user_tokens` tokens.
    multi-turn: conversations of `num_turns` turns (num_requests in all, the last conversation
    possibly shorter) after an optional system prompt: turn k's prompt repeats turns 1..k-1
    (each user turn followed by a stand-in answer as long as that turn's max_tokens) and adds a
    new user turn. A conversation starts at its `arrival` time; its turn k arrives
    `k * turn_interval` s later (pick an interval longer than a turn takes, as a chat user
    reads before answering, or later turns overtake the earlier ones).
    """

    num_requests: int = 64
    kind: WorkloadKind = "mixed"
    short_share: float = 0.5
    short_tokens: tuple[int, int] = (2, 8)
    long_tokens: tuple[int, int] = (64, 512)
    uniform_tokens: tuple[int, int] = (16, 256)
    prompt_words: tuple[int, int] = (16, 64)
    arrival: ArrivalKind = "all-at-once"
    request_rate: float = 1.0
    burstiness: float = 1.0
    seed: int = 0
    long_prompt_words: int = 6000
    long_prompt_arrival: float = 2.0
    system_prompt_tokens: int = 512
    num_prefixes: int = 1
    user_tokens: tuple[int, int] = (32, 64)
    token_id_range: tuple[int, int] = (1000, 20000)
    num_turns: int = 4
    turn_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"kind: must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
        if not 0.0 <= self.short_share <= 1.0:
            raise ValueError(f"short_share: must be in [0, 1], got {self.short_share}")
        for name in ("short_tokens", "long_tokens", "uniform_tokens", "prompt_words", "user_tokens",
                     "token_id_range"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= low <= high, got ({low}, {high})")
        if self.arrival not in ARRIVAL_KINDS:
            raise ValueError(f"arrival: must be one of {ARRIVAL_KINDS}, got {self.arrival!r}")
        if self.arrival != "all-at-once" and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.kind == "long-prompt" and (self.num_requests < 2 or self.long_prompt_words < 1
                                           or not self.long_prompt_arrival >= 0):
            raise ValueError("long-prompt: needs num_requests >= 2, long_prompt_words >= 1, long_prompt_arrival >= 0")
        if self.system_prompt_tokens < (self.kind == "shared-prefix"):
            raise ValueError(f"system_prompt_tokens: must be >= {int(self.kind == 'shared-prefix')}, "
                             f"got {self.system_prompt_tokens}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes: must be >= 1, got {self.num_prefixes}")
        if self.num_turns < 1 or not self.turn_interval >= 0:
            raise ValueError(f"num_turns >= 1 and turn_interval >= 0 needed, got {self.num_turns}, {self.turn_interval}")


def draw_arrival_times(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Cumulative arrival times (s) of `num_requests`; the first request arrives at 0.

    Intervals are gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean 1/rate for any
    burstiness; burstiness 1 is an exponential, i.e. a Poisson process. An infinite rate
    sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    theta = 1.0 / (request_rate * burstiness)
    intervals = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)  # [num_requests - 1]
    return [0.0] + np.cumsum(intervals).tolist()


def make_prompt(num_words: int, rng: np.random.Generator) -> str:
    """An instruction, then whole sentences from the corpus until about `num_words` words."""
    parts = [INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]]
    num_taken = len(parts[0].split())
    order = rng.permutation(len(SENTENCES))
    position = 0
    while num_taken < num_words:
        if position == len(order):  # long prompts: go round the corpus again, reshuffled
            order, position = rng.permutation(len(SENTENCES)), 0
        sentence = SENTENCES[int(order[position])]
        position += 1
        parts.append(sentence)
        num_taken += len(sentence.split())
    if parts[0].startswith("Answer the question"):
        parts.append(QUESTIONS[int(rng.integers(len(QUESTIONS)))])
    return " ".join(parts)


def distinct_prompt_ids(seed: int, length: int) -> list[int]:
    """`length` token ids that start differently for every seed below 5,700 (no prefix cache
    shares them): the prompts of the step-timing benchmarks."""
    return [(100 + 7 * seed + 13 * j) % 40000 + 10 for j in range(length)]


def generate_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """Draw `spec.num_requests` requests; the same spec always gives the same workload."""
    if spec.kind in ("shared-prefix", "multi-turn"):
        return _prefix_workload(spec)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests - (spec.kind == "long-prompt")
    if spec.kind == "mixed":
        num_short = int(round(spec.short_share * n))
        short = rng.integers(spec.short_tokens[0], spec.short_tokens[1] + 1, size=num_short)
        long = rng.integers(spec.long_tokens[0], spec.long_tokens[1] + 1, size=n - num_short)
        max_tokens = np.concatenate([short, long])[rng.permutation(n)]  # [n], shuffled
    else:
        max_tokens = rng.integers(spec.uniform_tokens[0], spec.uniform_tokens[1] + 1, size=n)
    prompt_words = rng.integers(spec.prompt_words[0], spec.prompt_words[1] + 1, size=n)
    prompts = [make_prompt(int(w), rng) for w in prompt_words]
    if spec.arrival == "all-at-once":
        arrivals = [0.0] * n
    else:
        burstiness = 1.0 if spec.arrival == "poisson" else spec.burstiness
        arrivals = draw_arrival_times(n, spec.request_rate, burstiness, rng)
    requests = [
        WorkloadRequest(max_tokens=int(m), prompt=p, arrival_time=a)
        for m, p, a in zip(max_tokens, prompts, arrivals)
    ]
    if spec.kind == "long-prompt":
        long_prompt = make_prompt(spec.long_prompt_words, rng)
        requests.append(WorkloadRequest(max_tokens=1, prompt=long_prompt, arrival_time=spec.long_prompt_arrival))
    return requests


def _prefix_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The shared-prefix and multi-turn kinds (see WorkloadSpec)."""
    rng = np.random.default_rng(spec.seed)
    low, high = spec.token_id_range

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(low, high + 1, size=n)]

    def user_turn() -> list[int]:
        return tokens(int(rng.integers(spec.user_tokens[0], spec.user_tokens[1] + 1)))

    def output_len() -> int:
        return int(rng.integers(spec.uniform_tokens[0], spec.uniform_tokens[1] + 1))

    systems = [tokens(spec.system_prompt_tokens) for _ in range(spec.num_prefixes)]
    turns_per_conversation = 1 if spec.kind == "shared-prefix" else spec.num_turns
    num_conversations = -(-spec.num_requests // turns_per_conversation)
    # Conversation c starts with system prompt c mod num_prefixes, in a shuffled order.
    system_of = [c % spec.num_prefixes for c in range(num_conversations)]
    if spec.num_prefixes > 1:
        system_of = [system_of[int(i)] for i in rng.permutation(num_conversations)]
    if spec.arrival == "all-at-once":
        starts = [0.0] * num_conversations
    else:
        burstiness = 1.0 if spec.arrival == "poisson" else spec.burstiness
        starts = draw_arrival_times(num_conversations, spec.request_rate, burstiness, rng)
    requests: list[WorkloadRequest] = []
    for start, system_index in zip(starts, system_of):
        history = list(systems[system_index])
        for turn in range(turns_per_conversation):
            if len(requests) == spec.num_requests:
                break
            max_tokens = output_len()
            prompt = history + user_turn()
            requests.append(WorkloadRequest(max_tokens=max_tokens, prompt_token_ids=prompt,
                                            arrival_time=start + turn * spec.turn_interval))
            history = prompt + tokens(max_tokens)  # the stand-in answer
    return sorted(requests, key=lambda r: r.arrival_s)


def save_workload(requests: list[WorkloadRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_json(), ensure_ascii=False) + "\n")


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read a JSON-lines workload; blank lines are skipped. Errors name the line."""
    requests: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError("each line must be a JSON object")
                requests.append(WorkloadRequest.from_json(data))
            except (ValueError, TypeError) as error:
                raise ValueError(f"{path}:{line_number}: {error}") from error
    if not requests:
        raise ValueError(f"{path}: the workload is empty")
    return requests


def with_arrivals(requests: list[WorkloadRequest], arrivals: list[float]) -> list[WorkloadRequest]:
    """A copy of `requests` with new arrival times (in the given order)."""
    if len(arrivals) != len(requests):
        raise ValueError("arrival_time: need one arrival per request")
    return [
        WorkloadRequest(r.max_tokens, r.prompt, r.prompt_token_ids, float(a))
        for r, a in zip(requests, arrivals)
    ]


def at_rate(requests: list[WorkloadRequest], request_rate: float, burstiness: float = 1.0,
            seed: int = 0) -> list[WorkloadRequest]:
    """`requests` (in order) with seeded arrivals at `request_rate` (inf: all at once): what
    `bench serve --request-rate R --burstiness B --seed S` sends, so the planner sees the same."""
    rng = np.random.default_rng(seed)
    return with_arrivals(requests, draw_arrival_times(len(requests), request_rate, burstiness, rng))


def describe_workload(requests: list[WorkloadRequest]) -> dict[str, Any]:
    """Counts and ranges, for reports."""
    max_tokens = [r.max_tokens for r in requests]
    arrivals = [r.arrival_s for r in requests]
    return {
        "num_requests": len(requests),
        "total_max_tokens": int(sum(max_tokens)),
        "min_max_tokens": int(min(max_tokens)),
        "max_max_tokens": int(max(max_tokens)),
        "last_arrival_s": float(max(arrivals)),
    }
