"""`backfill plan`: sweep serving configurations over a workload in simulation, pick the cheapest
that meets a latency SLO.

Each configuration (max_num_seqs, policy, replicas) serves the same requests, at the same
arrival times, in `simulator.simulate`; the rows carry the figures `bench serve` reports
(output throughput, TTFT and TPOT percentiles) and the cost per million output tokens at the
machine's hourly price (replicas are separate machines: N times the price).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from backfill.bench.cost_model import Calibration
from backfill.bench.economics import unit_economics
from backfill.bench.simulator import Routing, SimRequest, simulate
from backfill.bench.workloads import WorkloadRequest
from backfill.config import EngineConfig

SLO_FIELDS: tuple[str, ...] = ("ttft_p99_ms", "tpot_p99_ms", "ttft_p50_ms", "tpot_p50_ms")
# A row's key for each SLO field (metrics.summarize's names)
_SLO_KEYS: dict[str, str] = {"ttft_p99_ms": "p99_ttft_ms", "tpot_p99_ms": "p99_tpot_ms",
                             "ttft_p50_ms": "median_ttft_ms", "tpot_p50_ms": "median_tpot_ms"}
# The per-request lists of a summary, left out of a row
_LISTS: tuple[str, ...] = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors")


@dataclass(frozen=True)
class PlanPoint:
    """One configuration of the sweep."""

    max_num_seqs: int
    policy: str
    num_replicas: int = 1


def parse_slo(text: str | None) -> dict[str, float]:
    """`"ttft_p99_ms=500,tpot_p99_ms=80"` -> {"ttft_p99_ms": 500.0, "tpot_p99_ms": 80.0}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SLO_FIELDS:
            raise ValueError(f"slo: expected NAME=MS with NAME one of {SLO_FIELDS}, got {part.strip()!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"slo: {name} must be a number of ms, got {value.strip()!r}") from None
        if not slo[name] > 0:
            raise ValueError(f"slo: {name} must be > 0, got {value.strip()}")
    return slo


def sim_requests(requests: Sequence[WorkloadRequest], encode: Callable[[str], list[int]] | None) -> list[SimRequest]:
    """The engine's view of a workload: prompt ids (text encoded as the server does), lengths,
    arrivals. `encode` may be None when every prompt is given as token ids."""
    out = []
    for r in requests:
        if r.prompt_token_ids is not None:
            ids = list(r.prompt_token_ids)
        elif encode is None:
            raise ValueError("a text prompt needs the model's tokenizer")
        else:
            ids = encode(r.prompt or "")
        out.append(SimRequest(ids, r.max_tokens, r.arrival_s))
    return out


def sweep_points(max_num_seqs: Sequence[int], policies: Sequence[str], replicas: Sequence[int]) -> list[PlanPoint]:
    for value in list(max_num_seqs) + list(replicas):
        if value < 1:
            raise ValueError(f"max_num_seqs and replicas must be >= 1, got {value}")
    return [PlanPoint(s, p, n) for n, p, s in itertools.product(replicas, policies, max_num_seqs)]


def serve_warmup(requests: Sequence[SimRequest]) -> list[SimRequest]:
    """`bench serve`'s warm-up request (its default one): the first request's prompt, at most
    4 tokens."""
    first = min(requests, key=lambda r: r.arrival_s)
    return [SimRequest(first.prompt_token_ids, min(first.max_tokens, 4), 0.0)]


def run_point(requests: Sequence[SimRequest], base: EngineConfig, calibration: Calibration, point: PlanPoint,
              price_per_hour: float, routing: Routing = "least-loaded", served: bool = True) -> dict[str, Any]:
    """Simulate one configuration; its row (summary fields, slot use, cost, the configuration).
    Served, the first engine runs `bench serve`'s warm-up request first."""
    config = replace(base, max_num_seqs=point.max_num_seqs, policy=point.policy)  # type: ignore[arg-type]
    warmup = serve_warmup(requests) if served else []
    run = simulate(requests, config, calibration, point.num_replicas, routing, served, warmup=warmup)
    summary = run.summary(percentiles=(50.0, 99.0))
    econ = unit_economics(price_per_hour * point.num_replicas, run.duration, summary["total_output_tokens"])
    row = {k: v for k, v in summary.items() if k not in _LISTS}
    row.update(max_num_seqs=point.max_num_seqs, policy=point.policy, num_replicas=point.num_replicas,
               cost_per_million_output_tokens=econ["cost_per_million_output_tokens"], ttfts=summary["ttfts"],
               e2els=summary["e2els"])
    return row


def meets_slo(row: dict[str, Any], slo: dict[str, float]) -> bool:
    """Every request completed and every SLO figure is within its bound."""
    return row["failed"] == 0 and all(row[_SLO_KEYS[name]] <= bound for name, bound in slo.items())


def cheapest(rows: Sequence[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any] | None:
    """The row that meets `slo` at the lowest cost per output token (ties: higher throughput,
    then fewer replicas and slots); None when none meets it."""
    meeting = [r for r in rows if meets_slo(r, slo)]
    if not meeting:
        return None
    return min(meeting, key=lambda r: (r["cost_per_million_output_tokens"], -r["output_throughput"],
                                       r["num_replicas"], r["max_num_seqs"]))


def format_plan(rows: Sequence[dict[str, Any]], slo: dict[str, float], choice: dict[str, Any] | None) -> str:
    """A markdown table, one row per configuration, and the choice under `slo`."""
    lines = ["| replicas | policy | max_num_seqs | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
             "| slot use | USD / 1M output tok | SLO |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        ok = ("yes" if meets_slo(r, slo) else "no") if slo else "-"
        mark = " **<-**" if r is choice else ""
        lines.append(
            f"| {r['num_replicas']} | {r['policy']} | {r['max_num_seqs']} | {r['output_throughput']:.1f} | "
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
            f"{100 * r['slot_utilization']:.0f}% | {_money(r['cost_per_million_output_tokens'])} | {ok}{mark} |")
    if slo:
        bounds = ", ".join(f"{k} <= {v:g}" for k, v in slo.items())
        if choice is None:
            lines.append(f"\nNo configuration meets {bounds}.")
        else:
            lines.append(f"\nCheapest configuration meeting {bounds}: {choice['num_replicas']} replica(s), "
                         f"{choice['policy']}, max_num_seqs {choice['max_num_seqs']} "
                         f"({_money(choice['cost_per_million_output_tokens'])} USD per 1M output tokens).")
    return "\n".join(lines)


def _money(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.4f}"
