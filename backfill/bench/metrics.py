"""Latency and throughput metrics, as `vllm bench serve` defines and names them.

Pure functions over plain timestamps (seconds), so they are tested on hand-made numbers and
shared by the HTTP client, the offline engine run and the transformers baseline:
- TTFT: first token time - send (or arrival) time.
- ITL: the gaps between successive token events of one request (a chunk carrying several
  tokens is one event, as in vLLM).
- TPOT: (e2el - ttft) / (output_len - 1), for requests with more than one output token.
- E2EL: last event time - send time.
Percentiles interpolate linearly (numpy's default), reported in ms as `p{P}_{metric}_ms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

METRIC_NAMES: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request did, seen by whoever sent it. Times in seconds."""

    success: bool
    prompt_len: int = 0
    cached_len: int = 0  # prompt tokens the server found in its prefix cache (0: none or not reported)
    output_len: int = 0  # output tokens actually received
    expected_output_len: int = 0  # what the workload asked for
    start_time: float = 0.0  # when it was sent / arrived (any clock, same as the run's)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # end-to-end
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        return tpot(self.latency, self.ttft, self.output_len)

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency


def ttft(start_time: float, token_times: Sequence[float]) -> float:
    """Time to first token; raises if no token came."""
    if not token_times:
        raise ValueError("token_times: no token was received")
    return token_times[0] - start_time


def itl(token_times: Sequence[float]) -> list[float]:
    """Gaps between successive token events."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


def tpot(latency: float, ttft_s: float, output_len: int) -> float:
    """Mean time per output token after the first; 0 for one token or none (vLLM's convention)."""
    if output_len <= 1:
        return 0.0
    return (latency - ttft_s) / (output_len - 1)


def result_from_token_times(
    start_time: float,
    token_times: Sequence[float],
    output_len: int,
    expected_output_len: int,
    prompt_len: int = 0,
    end_time: float | None = None,
    generated_text: str = "",
    cached_len: int = 0,
) -> RequestResult:
    """A successful result from the times its token events arrived.

    `end_time` defaults to the last token event (what a streaming client sees); the
    transformers baseline passes the time `generate()` returned instead.
    """
    last = token_times[-1] if end_time is None else end_time
    return RequestResult(
        success=True,
        prompt_len=prompt_len,
        cached_len=cached_len,
        output_len=output_len,
        expected_output_len=expected_output_len,
        start_time=start_time,
        ttft=ttft(start_time, token_times),
        itl=itl(token_times),
        latency=last - start_time,
        generated_text=generated_text,
    )


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (linear interpolation); 0.0 for no values, as vLLM reports."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile: must be in [0, 100], got {p}")
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def stats_ms(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean / median / std / p{P} of seconds, in ms, keyed without the metric name."""
    arr = np.asarray(values, dtype=np.float64)
    out = {
        "mean": float(arr.mean()) * 1000 if arr.size else 0.0,
        "median": percentile(values, 50) * 1000,
        "std": float(arr.std()) * 1000 if arr.size else 0.0,
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = percentile(values, p) * 1000
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (SLOs in ms)."""
    slo: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {GOODPUT_METRICS}, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {name} needs a number of ms, got {value!r}") from None
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"goodput: {name} must be a positive number of ms, got {value}")
        slo[name] = ms
    return slo


def meets_slo(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    """True when a successful request is within every SLO (inclusive), like vLLM's goodput."""
    if not result.success:
        return False
    observed = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    return all(observed[name] * 1000 <= limit for name, limit in slo_ms.items())


def max_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an interval ending when another starts does not overlap)."""
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends sort before starts at the same instant
    current = best = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def token_event_times(result: RequestResult) -> list[float]:
    """Absolute times of a request's token events, rebuilt from its TTFT and ITLs."""
    if not result.success or result.output_len == 0:
        return []
    times = [result.start_time + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def max_output_tokens_per_s(results: Sequence[RequestResult]) -> float:
    """The busiest one-second bucket's token events (vLLM's `max_output_tokens_per_s`)."""
    done = [r for r in results if r.success]
    if not done:
        return 0.0
    origin = min(r.start_time for r in done)
    buckets: dict[int, int] = {}
    for r in done:
        for t in token_event_times(r):
            key = int(t - origin)
            buckets[key] = buckets.get(key, 0) + 1
    return float(max(buckets.values(), default=0))


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    goodput_slo_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """The `vllm bench serve` result fields for one run (plus a few of ours, named apart).

    Throughputs divide by `duration` (the run's wall time). Only successful requests count
    toward tokens and latencies; `output_lens` holds 0 for a failed one, as in vLLM.
    """
    if duration <= 0:
        raise ValueError(f"duration: must be > 0, got {duration}")
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    output_lens = [r.output_len if r.success else 0 for r in results]
    total_output = sum(output_lens)
    ttfts = [r.ttft for r in done]
    tpots = [r.tpot for r in done if r.output_len > 1]
    itls = [gap for r in done for gap in r.itl]
    e2els = [r.latency for r in done]
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        # Prefix caching: prompt tokens served from the cache (the server's usage
        # `prompt_tokens_details.cached_tokens`), and their share of all prompt tokens.
        "total_cached_input_tokens": sum(r.cached_len for r in done),
        "prefix_cache_hit_rate": sum(r.cached_len for r in done) / total_input if total_input else 0.0,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": (
            sum(meets_slo(r, goodput_slo_ms) for r in done) / duration if goodput_slo_ms else None
        ),
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": max_output_tokens_per_s(results),
        "max_concurrent_requests": max_concurrency((r.start_time, r.end_time) for r in done),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for key, value in stats_ms(values, percentiles).items():
            summary[f"{key}_{name}_ms"] = value
    summary["num_output_len_mismatch"] = sum(
        1 for r in done if r.expected_output_len and r.output_len != r.expected_output_len
    )
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = output_lens
    summary["ttfts"] = [r.ttft if r.success else 0.0 for r in results]
    summary["itls"] = [list(r.itl) for r in results]
    summary["e2els"] = [r.latency if r.success else 0.0 for r in results]
    summary["errors"] = [r.error for r in results]
    return summary


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The human-readable block `vllm bench serve` prints, from a `summarize()` dict."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = f"{value:{fmt}}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44} {text:>15}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    if "prefix_cache_hit_rate" in summary:
        row("Prefix cache hit rate (%):", 100 * summary["prefix_cache_hit_rate"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    headers = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for name, (short, header) in headers.items():
        lines.append(f"{header:-^60}")
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"])
        for key in summary:
            if key.startswith("p") and key.endswith(f"_{name}_ms") and key[1:].split("_")[0].replace(".", "").isdigit():
                row(f"P{key[1:].split('_')[0]} {short} (ms):", summary[key])
    lines.append("=" * 60)
    return "\n".join(lines)
