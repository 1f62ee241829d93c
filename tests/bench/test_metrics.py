"""Metric computations on hand-made timestamps: TTFT, TPOT, ITL, E2EL, percentiles, goodput."""

from __future__ import annotations

import pytest

from backfill.bench.metrics import (
    RequestResult,
    format_summary,
    itl,
    max_concurrency,
    max_output_tokens_per_s,
    meets_slo,
    parse_goodput,
    percentile,
    result_from_token_times,
    summarize,
    tpot,
    ttft,
)


def test_ttft_itl_tpot_e2el_from_token_times() -> None:
    # sent at 10.0; tokens at 10.5, 10.6, 10.8, 11.1
    r = result_from_token_times(10.0, [10.5, 10.6, 10.8, 11.1], output_len=4, expected_output_len=4, prompt_len=7)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.latency == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert ttft(1.0, [1.25]) == 0.25
    assert itl([1.0]) == []
    assert tpot(2.0, 1.0, 1) == 0.0
    assert tpot(2.0, 1.0, 0) == 0.0
    with pytest.raises(ValueError):
        ttft(0.0, [])


def test_end_time_override_for_non_streaming_baselines() -> None:
    r = result_from_token_times(0.0, [1.0, 2.0], output_len=2, expected_output_len=2, end_time=5.0)
    assert r.latency == 5.0 and r.ttft == 1.0 and r.tpot == 4.0


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([], 99) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_meets_slo_is_inclusive_and_failures_never_count() -> None:
    r = result_from_token_times(0.0, [0.5, 0.55, 0.6], output_len=3, expected_output_len=3)
    assert meets_slo(r, {"ttft": 500.0})  # exactly at the limit counts
    assert not meets_slo(r, {"ttft": 499.0})
    assert meets_slo(r, {"tpot": 50.0, "e2el": 600.0})
    assert not meets_slo(r, {"tpot": 49.0})
    assert not meets_slo(RequestResult(success=False), {"ttft": 1e9})


def test_max_concurrency_sweep() -> None:
    assert max_concurrency([(0, 2), (1, 3), (2, 4)]) == 2  # touching ends do not overlap
    assert max_concurrency([(0, 10), (1, 2), (1.5, 3), (1.8, 1.9)]) == 4
    assert max_concurrency([]) == 0


def _two_requests() -> list[RequestResult]:
    a = result_from_token_times(0.0, [0.2, 0.4, 0.6, 0.8, 1.0], output_len=5, expected_output_len=5, prompt_len=10)
    b = result_from_token_times(0.5, [1.5, 1.7], output_len=2, expected_output_len=3, prompt_len=4)
    failed = RequestResult(success=False, prompt_len=3, expected_output_len=9, error="HTTP 500")
    return [a, b, failed]


def test_summarize_has_the_vllm_fields_and_values() -> None:
    s = summarize(_two_requests(), duration=2.0, goodput_slo_ms={"ttft": 300.0}, percentiles=(50, 99))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 14 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 3.5
    assert s["total_token_throughput"] == 10.5
    assert s["request_goodput"] == 0.5  # only the first meets ttft <= 300 ms
    assert s["mean_ttft_ms"] == pytest.approx(600.0)  # (200 + 1000) / 2
    assert s["median_ttft_ms"] == pytest.approx(600.0)
    assert s["std_ttft_ms"] == pytest.approx(400.0)
    assert s["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 800)
    # tpot: a = (1.0 - 0.2) / 4 = 0.2 s; b = (1.2 - 1.0) / 1 = 0.2 s
    assert s["mean_tpot_ms"] == pytest.approx(200.0)
    # itl: four gaps of 0.2 and one of 0.2
    assert s["mean_itl_ms"] == pytest.approx(200.0) and s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["mean_e2el_ms"] == pytest.approx(1100.0)  # (1000 + 1200) / 2
    assert s["p50_e2el_ms"] == pytest.approx(1100.0)
    assert s["max_concurrent_requests"] == 2
    assert s["max_output_tokens_per_s"] == 4.0  # second [0, 1): a at 0.2..0.8; [1, 2): a at 1.0, b at 1.5, 1.7
    assert s["num_output_len_mismatch"] == 1
    assert s["output_lens"] == [5, 2, 0] and s["errors"] == ["", "", "HTTP 500"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in s
    text = format_summary(s)
    assert "Successful requests:" in text and "P99 TTFT (ms):" in text and "Mean E2EL (ms):" in text


def test_summarize_without_goodput_and_with_nothing_done() -> None:
    s = summarize([RequestResult(success=False)], duration=1.0)
    assert s["request_goodput"] is None and s["completed"] == 0
    assert s["mean_ttft_ms"] == 0.0 and s["p99_e2el_ms"] == 0.0
    with pytest.raises(ValueError, match="duration"):
        summarize([], duration=0.0)


def test_max_output_tokens_per_s_buckets() -> None:
    r = result_from_token_times(0.0, [0.1, 0.2, 0.3, 1.5], output_len=4, expected_output_len=4)
    assert max_output_tokens_per_s([r]) == 3.0
