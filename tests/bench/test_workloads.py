"""Workload generation: seeded, shares and ranges hold, arrivals as asked, JSON-lines round trip."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from backfill.bench.workloads import (
    WorkloadRequest,
    WorkloadSpec,
    draw_arrival_times,
    generate_workload,
    load_workload,
    save_workload,
)


def test_same_seed_same_workload_and_other_seed_differs() -> None:
    spec = WorkloadSpec(num_requests=32, seed=7)
    a, b = generate_workload(spec), generate_workload(spec)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    c = generate_workload(WorkloadSpec(num_requests=32, seed=8))
    assert [r.to_json() for r in a] != [r.to_json() for r in c]


@pytest.mark.parametrize("num_requests,share", [(64, 0.5), (50, 0.3), (10, 0.0), (9, 1.0)])
def test_mixed_shares_and_ranges_hold(num_requests: int, share: float) -> None:
    spec = WorkloadSpec(num_requests=num_requests, short_share=share, short_tokens=(2, 8), long_tokens=(64, 512))
    requests = generate_workload(spec)
    assert len(requests) == num_requests
    short = [r.max_tokens for r in requests if r.max_tokens <= 8]
    long = [r.max_tokens for r in requests if r.max_tokens > 8]
    assert len(short) == round(share * num_requests)
    assert all(2 <= m <= 8 for m in short)
    assert all(64 <= m <= 512 for m in long)
    assert all(r.arrival_time == 0.0 for r in requests)


def test_mixed_is_shuffled_and_spans_the_range() -> None:
    requests = generate_workload(WorkloadSpec(num_requests=400, seed=1))
    kinds = ["s" if r.max_tokens <= 8 else "l" for r in requests]
    assert kinds[:200] != ["s"] * 200 and kinds[:200] != ["l"] * 200  # not sorted by kind
    longs = [r.max_tokens for r in requests if r.max_tokens > 8]
    assert min(longs) < 100 and max(longs) > 470  # draws cover the range, not one value


def test_uniform_range_holds() -> None:
    requests = generate_workload(WorkloadSpec(num_requests=200, kind="uniform", uniform_tokens=(10, 20)))
    values = [r.max_tokens for r in requests]
    assert min(values) >= 10 and max(values) <= 20 and len(set(values)) > 5


def test_prompts_are_varied_real_text_of_the_asked_length() -> None:
    requests = generate_workload(WorkloadSpec(num_requests=40, prompt_words=(20, 30)))
    prompts = [r.prompt for r in requests]
    assert all(p is not None for p in prompts)
    assert len(set(prompts)) == 40
    for prompt in prompts:
        assert prompt is not None
        words = prompt.split()
        assert 20 <= len(words) <= 30 + 30  # the last whole sentence may overshoot, bounded
        assert len(set(words)) > len(words) / 2  # not one repeated token


def test_poisson_arrivals_have_the_asked_rate() -> None:
    requests = generate_workload(WorkloadSpec(num_requests=2000, arrival="poisson", request_rate=4.0))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = np.diff(arrivals)
    assert abs(gaps.mean() - 0.25) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential: coefficient of variation 1


def test_gamma_burstiness_changes_variance_not_mean() -> None:
    rng = np.random.default_rng(0)
    bursty = np.diff(draw_arrival_times(4000, 2.0, 0.25, rng))
    smooth = np.diff(draw_arrival_times(4000, 2.0, 4.0, rng))
    assert abs(bursty.mean() - 0.5) < 0.05 and abs(smooth.mean() - 0.5) < 0.05
    assert bursty.std() / bursty.mean() > 1.7  # CV = 1/sqrt(shape) = 2
    assert smooth.std() / smooth.mean() < 0.6  # CV = 0.5


def test_infinite_rate_sends_all_at_once() -> None:
    assert draw_arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 5


def test_round_trip_and_token_id_prompts(tmp_path: Path) -> None:
    requests = generate_workload(WorkloadSpec(num_requests=5, arrival="gamma", request_rate=3, burstiness=0.5))
    requests.append(WorkloadRequest(max_tokens=3, prompt_token_ids=[1, 2, 3]))
    path = tmp_path / "w.jsonl"
    save_workload(requests, path)
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"prompt_token_ids": [1, 2, 3], "max_tokens": 3}
    loaded = load_workload(path)
    assert [r.to_json() for r in loaded] == [r.to_json() for r in requests]


@pytest.mark.parametrize(
    "line,field",
    [
        ('{"prompt": "hi"}', "max_tokens"),
        ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
        ('{"max_tokens": 3}', "prompt"),
        ('{"prompt": "hi", "prompt_token_ids": [1], "max_tokens": 3}', "prompt"),
        ('{"prompt_token_ids": [], "max_tokens": 3}', "prompt_token_ids"),
        ('{"prompt": "hi", "max_tokens": 3, "arrival_time": -1}', "arrival_time"),
        ('{"prompt": "hi", "max_tokens": 3, "temperature": 1}', "unknown"),
    ],
)
def test_bad_lines_name_the_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 1}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:3: .*{field}"):
        load_workload(path)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="short_share"):
        WorkloadSpec(short_share=1.5)
    with pytest.raises(ValueError, match="long_tokens"):
        WorkloadSpec(long_tokens=(10, 5))
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadSpec(arrival="poisson", request_rate=0)


def test_long_prompt_workload_is_streams_then_one_long_prompt() -> None:
    spec = WorkloadSpec(num_requests=9, kind="long-prompt", uniform_tokens=(300, 300), long_prompt_words=2000,
                        long_prompt_arrival=1.5, seed=3)
    requests = generate_workload(spec)
    assert len(requests) == 9
    streams, long = requests[:-1], requests[-1]
    assert all(r.max_tokens == 300 and r.arrival_s == 0.0 for r in streams)
    assert long.max_tokens == 1 and long.arrival_s == 1.5
    assert long.prompt is not None and len(long.prompt.split()) >= 2000
    assert generate_workload(spec) == requests  # seeded
    with pytest.raises(ValueError, match="long-prompt"):
        WorkloadSpec(num_requests=1, kind="long-prompt")


def test_shared_prefix_workload_shares_an_exact_system_prompt() -> None:
    spec = WorkloadSpec(num_requests=64, kind="shared-prefix", system_prompt_tokens=512, user_tokens=(32, 64),
                        uniform_tokens=(32, 32))
    requests = generate_workload(spec)
    assert len(requests) == 64 and all(r.max_tokens == 32 and r.arrival_s == 0.0 for r in requests)
    system = requests[0].prompt_token_ids[:512]  # type: ignore[index]
    for request in requests:
        ids = request.prompt_token_ids
        assert ids is not None and ids[:512] == system and 512 + 32 <= len(ids) <= 512 + 64
        assert all(1000 <= t <= 20000 for t in ids)
    assert len({tuple(r.prompt_token_ids[512:]) for r in requests}) == 64  # type: ignore[index]
    assert generate_workload(spec) == requests


def test_shared_prefix_workload_spreads_requests_evenly_over_its_prefixes() -> None:
    spec = WorkloadSpec(num_requests=128, kind="shared-prefix", num_prefixes=8, system_prompt_tokens=64,
                        user_tokens=(8, 16))
    requests = generate_workload(spec)
    systems = [tuple(r.prompt_token_ids[:64]) for r in requests]  # type: ignore[index]
    assert sorted(Counter(systems).values()) == [16] * 8
    assert systems[:8] != systems[8:16] and len(set(systems[:16])) > 1  # shuffled, not in runs
    assert generate_workload(spec) == requests
    with pytest.raises(ValueError, match="num_prefixes"):
        WorkloadSpec(kind="shared-prefix", num_prefixes=0)


def test_multi_turn_workload_repeats_earlier_turns_as_prefix() -> None:
    spec = WorkloadSpec(num_requests=10, kind="multi-turn", num_turns=4, turn_interval=5.0,
                        system_prompt_tokens=20, user_tokens=(8, 8), uniform_tokens=(4, 4))
    requests = generate_workload(spec)
    assert len(requests) == 10 and [r.arrival_s for r in requests] == [0.0] * 3 + [5.0] * 3 + [10.0] * 2 + [15.0] * 2
    by_conversation: dict[tuple[int, ...], list] = {}  # type: ignore[type-arg]
    for request in requests:
        by_conversation.setdefault(tuple(request.prompt_token_ids[:28]), []).append(request)  # type: ignore[index]
    assert sorted(len(turns) for turns in by_conversation.values()) == [2, 4, 4]
    for turns in by_conversation.values():
        for k, (earlier, later) in enumerate(zip(turns, turns[1:])):
            # each turn: the previous prompt + a 4-token stand-in answer + an 8-token user turn
            assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
            assert len(later.prompt_token_ids) == len(earlier.prompt_token_ids) + 4 + 8
    with pytest.raises(ValueError, match="system_prompt_tokens"):
        WorkloadSpec(kind="shared-prefix", system_prompt_tokens=0)
