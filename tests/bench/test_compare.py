"""The comparison report's arithmetic on hand-made summaries."""

from __future__ import annotations

import pytest

from backfill.bench.compare import compute_ratios, format_compare, median_index, median_summary


def _summary(tps: float, p50: float, p99: float) -> dict[str, float]:
    return {"output_throughput": tps, "request_throughput": tps / 100, "p50_e2el_ms": p50, "p99_e2el_ms": p99,
            "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "useful_slot_share": 0.5}


def test_medians_ratios_and_table() -> None:
    medians = {
        "continuous": median_summary([_summary(100, 10, 50), _summary(140, 12, 40), _summary(150, 8, 45)]),
        "static": median_summary([_summary(70, 20, 90)]),
        "hf": median_summary([_summary(20, 60, 200), _summary(30, 50, 150)]),
    }
    assert medians["continuous"]["output_throughput"] == 140
    assert medians["continuous"]["p99_e2el_ms"] == 45
    assert medians["hf"]["output_throughput"] == 25
    ratios = compute_ratios(medians)
    assert ratios["continuous_vs_static_output_throughput"] == pytest.approx(2.0)
    assert ratios["continuous_vs_hf_output_throughput"] == pytest.approx(140 / 25)
    assert ratios["static_vs_continuous_p99_e2el"] == pytest.approx(2.0)
    assert ratios["hf_vs_continuous_p50_e2el"] == pytest.approx(55 / 10)
    report = {"medians": medians, "ratios": ratios, "config": {"repeats": 3, "dtype": "float32", "batch_size": 16}}
    table = format_compare(report)
    assert "| backfill continuous | 140.0 |" in table and "2.00x output throughput" in table


def test_ratios_pair_the_rounds() -> None:
    """Each ratio is the median of the rounds' own ratios, each round's two runs side by side on
    the machine as it was then; the ratio of the medians would divide figures of different rounds."""
    runs = {"continuous": [_summary(300, 10, 20), _summary(100, 30, 60), _summary(320, 10, 20)],
            "static": [_summary(100, 20, 60), _summary(50, 60, 120), _summary(160, 20, 40)]}
    medians = {name: median_summary(summaries) for name, summaries in runs.items()}
    assert compute_ratios(medians)["continuous_vs_static_output_throughput"] == pytest.approx(3.0)  # 300 / 100
    paired = compute_ratios(medians, runs)
    assert paired["continuous_vs_static_output_throughput"] == pytest.approx(2.0)  # of 3.0, 2.0, 2.0
    assert paired["static_vs_continuous_p99_e2el"] == pytest.approx(2.0)  # of 3.0, 2.0, 2.0
    # A round still running (static not yet measured) pairs nothing new
    partial = {"continuous": runs["continuous"] + [_summary(1, 1, 1)], "static": runs["static"]}
    assert compute_ratios(medians, partial) == paired


def test_ratios_need_continuous() -> None:
    assert compute_ratios({"static": {"output_throughput": 1.0}}) == {}


def test_median_index_picks_the_repeat_to_show() -> None:
    assert median_index([27.7, 145.1, 147.7]) == 1
    assert median_index([3.0]) == 0
    assert median_index([4.0, 1.0, 3.0, 2.0]) == 3  # lower middle of an even count
