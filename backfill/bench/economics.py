"""Unit economics: what a run's tokens cost on a machine billed by the hour.

The machine costs the same whether its batch slots do useful work or not, so every slot-step
that is idle (held by a finished request) or empty (nothing admitted) is money spent on
nothing. That share comes from the engine's step statistics (offline runs) or, for a remote
server, from an estimate: the slot-seconds no in-flight request occupied.
"""

from __future__ import annotations

from typing import Any, Iterable

from backfill.bench.metrics import RequestResult

SECONDS_PER_HOUR = 3600.0


def unit_economics(
    price_per_hour: float,
    duration_s: float,
    output_tokens: int,
    wasted_share: float | None = None,
    wasted_share_source: str = "",
) -> dict[str, Any]:
    """Cost of the run, cost per million output tokens, and the money spent on wasted slots.

    `wasted_share` is the fraction of slot capacity (slot-steps) that produced no requested
    token; None when unknown. Cost per million tokens assumes the machine would keep this
    throughput for as long as it is paid for.
    """
    if price_per_hour < 0:
        raise ValueError(f"price_per_hour: must be >= 0, got {price_per_hour}")
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    if wasted_share is not None and not 0.0 <= wasted_share <= 1.0:
        raise ValueError(f"wasted_share: must be in [0, 1], got {wasted_share}")
    run_cost = price_per_hour * duration_s / SECONDS_PER_HOUR
    per_million = run_cost / output_tokens * 1e6 if output_tokens else float("inf")
    result: dict[str, Any] = {
        "price_per_hour": price_per_hour,
        "run_cost": run_cost,
        "cost_per_million_output_tokens": per_million,
        "wasted_slot_share": wasted_share,
        "wasted_slot_share_source": wasted_share_source or None,
        "idle_slot_cost": None if wasted_share is None else run_cost * wasted_share,
        "idle_slot_cost_per_million_output_tokens": None if wasted_share is None else per_million * wasted_share,
    }
    return result


def estimate_wasted_share(results: Iterable[RequestResult], num_slots: int, duration_s: float) -> float:
    """1 - (slot-seconds occupied by in-flight requests, at most `num_slots` at once) / capacity.

    A client cannot see a server's slots, so this counts a request as holding a slot from
    send to last token; queued requests beyond `num_slots` fill no extra slot. An estimate:
    prefer the engine's own step statistics where there are some.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
    events: list[tuple[float, int]] = []
    for r in results:
        if r.success:
            events += [(r.start_time, 1), (r.end_time, -1)]
    if not events:
        return 1.0
    events.sort(key=lambda e: (e[0], e[1]))
    occupied = 0.0
    in_flight = 0
    previous = events[0][0]
    for t, delta in events:
        occupied += min(in_flight, num_slots) * (t - previous)
        in_flight += delta
        previous = t
    return max(0.0, 1.0 - occupied / (num_slots * duration_s))


def format_economics(econ: dict[str, Any]) -> str:
    lines = [
        f"{' Unit economics ':-^60}",
        f"{'Machine price (USD/hour):':<44} {econ['price_per_hour']:>15.4f}",
        f"{'Cost of this run (USD):':<44} {econ['run_cost']:>15.6f}",
        f"{'Cost per million output tokens (USD):':<44} {econ['cost_per_million_output_tokens']:>15.4f}",
    ]
    if econ["wasted_slot_share"] is not None:
        source = f" ({econ['wasted_slot_share_source']})" if econ.get("wasted_slot_share_source") else ""
        lines += [
            f"{'Slot capacity wasted (%):':<44} {100 * econ['wasted_slot_share']:>15.1f}{source}",
            f"{'Spent on idle/empty slots (USD):':<44} {econ['idle_slot_cost']:>15.6f}",
            f"{'  ... per million output tokens (USD):':<44} {econ['idle_slot_cost_per_million_output_tokens']:>15.4f}",
        ]
    return "\n".join(lines)
