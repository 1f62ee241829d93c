"""ServerMetrics from hand-written engine outputs: what each series counts."""

from __future__ import annotations

import re

from backfill.core.outputs import StepStats
from backfill.engine.messages import CoreLoad
from backfill.entrypoints.openai.metrics import ServerMetrics
from backfill.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(token_ids: list[int], new: int, finish: str | None, first: float, last: float,
            done_at: float | None = None) -> RequestOutput:
    completion = CompletionOutput(index=0, token_ids=token_ids, finish_reason=finish,
                                  delta_token_ids=token_ids[-new:])
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.5, first_token_time=first,
                             last_token_time=last, finish_time=done_at)
    return RequestOutput("r", None, [1, 2, 3], [completion], finish is not None, metrics)


def _stats(useful: int, idle: int) -> StepStats:
    return StepStats(step=1, start_time=0.0, duration=0.01, num_batched_tokens=useful, num_prefill_tokens=0,
                     num_decode_tokens=useful, num_running=useful + idle, num_waiting=0, num_kv_blocks_used=1,
                     num_kv_blocks_total=10, num_preempted=0, num_slots=4, num_slots_useful=useful,
                     num_slots_idle=idle)


def _samples(metrics: ServerMetrics, stats: CoreLoad, queued: int = 0) -> dict[str, float]:
    text = metrics.render(stats, queued).decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model_name="m",?', "", key.replace('",model_name="m"', '"'))
            samples[key.replace("{}", "")] = float(value)
    return samples


def test_series_exist_before_traffic() -> None:
    samples = _samples(ServerMetrics("m", 4), CoreLoad())
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "batch_slots_used", "batch_slots_idle"):
        assert samples["backfill:" + name] == 0, name
    assert samples['backfill:request_success_total{finished_reason="stop"}'] == 0


def test_cache_config_info_labels_the_kv_cache() -> None:
    config = {"block_size": 16, "cache_dtype": "float32", "num_gpu_blocks": 512, "enable_prefix_caching": True}
    samples = _samples(ServerMetrics("m", 4, cache_config=config), CoreLoad())
    key = ('backfill:cache_config_info{block_size="16",cache_dtype="float32",enable_prefix_caching="True",'
           'num_gpu_blocks="512"}')
    assert samples[key] == 1
    assert not any("cache_config" in k for k in _samples(ServerMetrics("m", 4), CoreLoad()))


def test_one_request_through_three_steps() -> None:
    metrics = ServerMetrics("m", 4)
    metrics.on_step([_output([7], 1, None, first=1.0, last=1.0)], _stats(useful=1, idle=0))
    metrics.on_step([_output([7, 8], 1, None, first=1.0, last=1.25)], _stats(useful=1, idle=0))
    metrics.on_step([_output([7, 8, 9], 1, "length", first=1.0, last=1.75, done_at=1.75)], _stats(useful=1, idle=2))
    samples = _samples(metrics, CoreLoad(num_running=2, num_waiting=1, num_kv_blocks_used=5,
                                            num_kv_blocks_total=10, num_preemptions_total=3), queued=4)
    assert samples["backfill:prompt_tokens_total"] == 3
    assert samples["backfill:generation_tokens_total"] == 3
    assert samples["backfill:time_to_first_token_seconds_count"] == 1
    assert samples["backfill:time_to_first_token_seconds_sum"] == 1.0
    assert samples["backfill:request_queue_time_seconds_sum"] == 0.5
    assert samples["backfill:inter_token_latency_seconds_count"] == 2
    assert samples["backfill:inter_token_latency_seconds_sum"] == 0.75
    assert samples["backfill:e2e_request_latency_seconds_sum"] == 1.75
    assert samples['backfill:request_success_total{finished_reason="length"}'] == 1
    assert samples["backfill:batch_slots_used"] == 1 and samples["backfill:batch_slots_idle"] == 2
    assert samples["backfill:batch_slot_steps_idle_total"] == 2 and samples["backfill:engine_steps_total"] == 3
    assert samples["backfill:num_requests_running"] == 2 and samples["backfill:num_requests_waiting"] == 4
    assert samples["backfill:kv_cache_usage_perc"] == 0.5 and samples["backfill:num_preemptions_total"] == 3
    # The preemption counter follows the engine's cumulative count without double counting.
    samples = _samples(metrics, CoreLoad(num_preemptions_total=3))
    assert samples["backfill:num_preemptions_total"] == 3


def test_prefix_cache_counters_and_cached_free_gauge() -> None:
    metrics = ServerMetrics("m", 4)
    samples = _samples(metrics, CoreLoad())
    assert samples["backfill:prefix_cache_queries_total"] == 0 == samples["backfill:prefix_cache_hits_total"]
    stats = _stats(useful=1, idle=0)
    stats.num_prefix_cache_queries, stats.num_prefix_cache_hits = 30, 16
    metrics.on_step([], stats)
    stats.num_prefix_cache_queries, stats.num_prefix_cache_hits = 10, 0
    metrics.on_step([], stats)
    samples = _samples(metrics, CoreLoad(num_kv_blocks_used=2, num_kv_blocks_total=10, num_kv_blocks_cached_free=3))
    assert samples["backfill:prefix_cache_queries_total"] == 40 and samples["backfill:prefix_cache_hits_total"] == 16
    # Cached free blocks are not "used": the usage gauge excludes them, their own gauge shows them.
    assert samples["backfill:kv_cache_usage_perc"] == 0.2 and samples["backfill:kv_cache_cached_free_perc"] == 0.3
