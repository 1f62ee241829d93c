"""PNG figures of benchmark runs (matplotlib, Agg backend: no display needed).

Inputs are plain data (lists of slot states, result dicts), so plots are drawn the same from
a live run or from saved JSON. matplotlib is the optional extra `bench`: it is imported when a
figure is drawn, and `require_matplotlib()` says what to install where it is missing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

INSTALL_HINT = "pip install 'backfill[bench]'"

SLOT_STATES: tuple[str, ...] = ("useful", "idle", "empty")
SLOT_COLORS: tuple[str, ...] = ("#2e9e4f", "#e8833a", "#e6e6e6")  # green, orange, light grey
ADMIT_COLOR = "#0b4d1f"  # dark green: the step a new request took the slot
ADMIT_CODE = len(SLOT_STATES)


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message says how to install it."""


def require_matplotlib() -> None:
    """Raise MissingExtraError, naming the extra to install, where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"plots need matplotlib, backfill's optional `bench` extra: {INSTALL_HINT}") from exc


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def slot_matrix(
    slot_states: Sequence[Sequence[str]], slot_request_ids: Sequence[Sequence[str | None]] | None = None
) -> np.ndarray:
    """[num_slots, num_steps] codes (0 useful, 1 idle, 2 empty) from per-step slot states.

    With `slot_request_ids`, a useful cell whose request differs from the slot's previous one
    gets ADMIT_CODE (3): the moment a request was admitted into that slot.
    """
    num_slots = max((len(s) for s in slot_states), default=0)
    codes = {name: i for i, name in enumerate(SLOT_STATES)}
    matrix = np.full((num_slots, len(slot_states)), 2, dtype=np.int8)  # [num_slots, num_steps]
    previous: list[str | None] = [None] * num_slots
    for step, states in enumerate(slot_states):
        ids = slot_request_ids[step] if slot_request_ids is not None else None
        for slot, state in enumerate(states):
            matrix[slot, step] = codes[state]
            if ids is not None and slot < len(ids):
                if state == "useful" and ids[slot] is not None and ids[slot] != previous[slot]:
                    matrix[slot, step] = ADMIT_CODE
                previous[slot] = ids[slot]
    return matrix


def slot_shares(slot_states: Sequence[Sequence[str]]) -> dict[str, float]:
    """Fraction of all slot-steps in each state."""
    matrix = slot_matrix(slot_states)
    total = max(matrix.size, 1)
    return {name: float((matrix == i).sum()) / total for i, name in enumerate(SLOT_STATES)}


def plot_slot_timeline(
    timelines: Mapping[str, Sequence[Sequence[str]]],
    path: str | Path,
    durations_s: Mapping[str, float] | None = None,
    request_ids: Mapping[str, Sequence[Sequence[str | None]]] | None = None,
    title: str = "Slot occupancy: one row per batch slot, one column per engine step",
) -> Path:
    """One panel per run (e.g. static above continuous), sharing the step axis.

    A slot is useful (its request produced a token or a prompt chunk), idle (held by a request
    that has finished, or waits for its batch), or empty (nothing admitted). With
    `request_ids`, a dark tick marks each step where a new request took a slot.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.2 + 1.6 * len(names)), sharex=True, squeeze=False)
    cmap = ListedColormap(list(SLOT_COLORS) + [ADMIT_COLOR])
    max_steps = max((len(t) for t in timelines.values()), default=1)
    for ax, name in zip(axes[:, 0], names):
        ids = request_ids.get(name) if request_ids else None
        matrix = slot_matrix(timelines[name], ids)
        ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=ADMIT_CODE,
                  extent=(0, matrix.shape[1], matrix.shape[0], 0))
        shares = slot_shares(timelines[name])
        label = f"{name}: {matrix.shape[1]} steps, {100 * shares['useful']:.0f}% of slot-steps useful"
        if durations_s and name in durations_s:
            label += f", {durations_s[name]:.1f} s"
        ax.set_title(label, loc="left", fontsize=10)
        ax.set_ylabel("slot")
        ax.set_xlim(0, max_steps)
    axes[-1, 0].set_xlabel("engine step")
    handles = [Patch(color=c, label=s) for s, c in zip(SLOT_STATES, SLOT_COLORS)]
    if request_ids:
        handles.append(Patch(color=ADMIT_COLOR, label="a new request takes the slot"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, path)


def _rate_value(rate: Any, finite_rates: Sequence[float]) -> float:
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        return float(rate)
    # "inf" / "workload": place to the right of the largest finite rate
    return (max(finite_rates) * 2) if finite_rates else 1.0


def plot_rate_sweep(series: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path) -> Path:
    """Output throughput and p99 TTFT vs request rate, one line per server / system."""
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, results in series.items():
        finite = [float(r["request_rate"]) for r in results
                  if isinstance(r["request_rate"], (int, float)) and math.isfinite(r["request_rate"])]
        points = sorted((_rate_value(r["request_rate"], finite), r) for r in results)
        xs = [p[0] for p in points]
        ax_tp.plot(xs, [p[1]["output_throughput"] for p in points], marker="o", label=name)
        ax_ttft.plot(xs, [p[1]["p99_ttft_ms"] for p in points], marker="o", label=name)
        for x, r in points:
            if not (isinstance(r["request_rate"], (int, float)) and math.isfinite(r["request_rate"])):
                ax_tp.annotate(str(r["request_rate"]), (x, r["output_throughput"]), fontsize=8)
    ax_tp.set_xlabel("request rate (req/s)")
    ax_tp.set_ylabel("output throughput (tok/s)")
    ax_ttft.set_xlabel("request rate (req/s)")
    ax_ttft.set_ylabel("p99 TTFT (ms)")
    ax_ttft.set_yscale("log")
    return _finish(fig, (ax_tp, ax_ttft), "Throughput and tail latency vs offered load", path)


def plot_latency_cdf(series: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path) -> Path:
    """CDFs of TTFT and end-to-end latency (seconds in, seconds on the axis), one line per system."""
    metrics = [("ttft", "time to first token (s)"), ("e2el", "end-to-end latency (s)")]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 4))
    for ax, (key, label) in zip(axes, metrics):
        for name, values in series.items():
            data = np.sort(np.asarray(values.get(key, []), dtype=np.float64))
            if data.size == 0:
                continue
            ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    return _save(fig, path)


def plot_plan(rows: Sequence[Mapping[str, Any]], slo: Mapping[str, float], choice: Mapping[str, Any] | None,
              path: str | Path) -> Path:
    """The planner's sweep: output throughput vs max_num_seqs, and p99 TTFT vs cost per 1M
    output tokens (the SLO's TTFT bound dashed, the chosen configuration ringed); one line
    per (policy, replicas)."""
    plt = _pyplot()
    fig, (ax_tp, ax_cost) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        series.setdefault(f"{r['policy']}, {r['num_replicas']} replica(s)", []).append(r)
    for name, points in series.items():
        points = sorted(points, key=lambda r: r["max_num_seqs"])
        ax_tp.plot([r["max_num_seqs"] for r in points], [r["output_throughput"] for r in points], marker="o", label=name)
        ax_cost.plot([r["cost_per_million_output_tokens"] for r in points], [r["p99_ttft_ms"] for r in points],
                     marker="o", label=name)
        for r in points:
            ax_cost.annotate(str(r["max_num_seqs"]), (r["cost_per_million_output_tokens"], r["p99_ttft_ms"]), fontsize=8)
    if "ttft_p99_ms" in slo:
        ax_cost.axhline(slo["ttft_p99_ms"], color="grey", linestyle="--", label="SLO p99 TTFT")
    if choice is not None:
        ax_cost.scatter([choice["cost_per_million_output_tokens"]], [choice["p99_ttft_ms"]], s=200,
                        facecolors="none", edgecolors="black", label="cheapest meeting the SLO")
    ax_tp.set_xscale("log", base=2)
    ax_tp.set_xlabel("max_num_seqs")
    ax_tp.set_ylabel("output throughput (tok/s)")
    ax_cost.set_xlabel("cost per 1M output tokens (USD)")
    ax_cost.set_ylabel("p99 TTFT (ms)")
    ax_cost.set_yscale("log")
    return _finish(fig, (ax_tp, ax_cost), "Capacity plan (simulated on the calibrated step-time model)", path,
                   legend_size=8)


def _finish(fig: Any, axes: Sequence[Any], title: str, path: str | Path, legend_size: int = 9) -> Path:
    """Grid and legend on every axis, the title, then save."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out
