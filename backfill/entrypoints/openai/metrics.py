"""ServerMetrics: the Prometheus registry of the server, fed by engine outputs and step stats.

Names follow vLLM's (`vllm:num_requests_running` is `backfill:num_requests_running`) so that
existing dashboards work after a prefix change. Gauges of engine state are read from the
AsyncEngine's snapshot at scrape time; counters and histograms are updated from every step's
outputs on the event loop (`on_step`).
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from backfill.core.outputs import StepStats
from backfill.engine.messages import CoreLoad
from backfill.outputs import RequestOutput

PREFIX = "backfill:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# The buckets vLLM uses, so that histograms line up on shared dashboards.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
FIRST_TOKEN_STEP_BUCKETS = [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    """One registry per server (not the global one), so several apps can live in one process.

    Implements the AsyncEngine's `EngineObserver`: call `on_step` with each step's outputs and
    `on_abort` with aborted request ids; call `render(stats)` to scrape.
    """

    def __init__(self, model_name: str, max_num_seqs: int, cache_config: dict[str, object] | None = None) -> None:
        # NOTE: process-wide; the `*_created` series only double the scrape (vLLM drops them too).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        # Every series but request_success has the one label, bound here once: `labels()` looks a
        # child up under a lock, and the event loop updates a dozen series each step. Binding also
        # exports each series from the start (at 0), so rates and alerts work before traffic.
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Sequences waiting to run (engine queue plus not yet picked up).")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage (blocks held by requests); 1 means 100 percent.")
        self.kv_cache_cached_free_perc = gauge(
            "kv_cache_cached_free_perc",
            "KV blocks held by no request but still holding a reusable prefix (evicted on demand); 1 means 100 percent.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (each sequence at its admission).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.batch_slots_used = gauge("batch_slots_used", "Batch slots whose sequence advanced in the last step.")
        self.batch_slots_idle = gauge(
            "batch_slots_idle", "Batch slots held in the last step by a sequence that did no useful work.")
        self.batch_slots_empty = gauge("batch_slots_empty", "Batch slots left empty in the last step.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(PREFIX + "request_success", "Finished sequences, by finish reason.",
                                        [*labels, "finished_reason"], registry=self.registry)
        self._request_success_by_reason: dict[str, Counter] = {}
        for reason in ("stop", "length"):
            self._request_success_child(reason)
        self.request_abort = counter("request_abort", "Requests aborted (client gone or shutdown).")
        self.request_timeout = counter("request_timeout", "Sequences ended by their deadline (HTTP 408).")
        self.engine_steps = counter("engine_steps", "Engine steps run.")
        self.step_duration = histogram("engine_step_duration_seconds", "Wall time of one engine step.", ITL_BUCKETS)
        self.slot_steps_used = counter("batch_slot_steps_used", "Sum over steps of batch_slots_used.")
        self.slot_steps_idle = counter("batch_slot_steps_idle", "Sum over steps of batch_slots_idle.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.ttft_steps = histogram("time_to_first_token_steps",
                                    "Engine steps from arrival at the core to the first token (1: the next step).",
                                    FIRST_TOKEN_STEP_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        if cache_config is not None:
            # vLLM's info gauge: the KV cache's set-up as labels, value 1 (num_gpu_blocks: vLLM's
            # name for the engine's KV blocks, on any device)
            info = Gauge(PREFIX + "cache_config_info", "Information of the KV cache's configuration.",
                         sorted(cache_config), registry=self.registry)
            info.labels(**{k: str(v) for k, v in cache_config.items()}).set(1)
        self._last_token_time: dict[str, float] = {}  # request id -> last token time seen
        self._num_preemptions_seen = 0

    def on_step(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        if stats is not None:
            self.engine_steps.inc()
            self.step_duration.observe(stats.duration)
            self.batch_slots_used.set(stats.num_slots_useful)
            self.batch_slots_idle.set(stats.num_slots_idle)
            empty = max(stats.num_slots - stats.num_slots_useful - stats.num_slots_idle, 0)
            self.batch_slots_empty.set(empty)
            self.slot_steps_used.inc(stats.num_slots_useful)
            self.slot_steps_idle.inc(stats.num_slots_idle)
            self.prefix_cache_queries.inc(stats.num_prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.num_prefix_cache_hits)
        for output in outputs:
            self._observe_output(output)

    def _observe_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        num_new = sum(len(completion.delta_token_ids) for completion in output.outputs)
        self.generation_tokens.inc(num_new)
        previous = self._last_token_time.get(output.request_id)
        if previous is None and metrics.first_token_time is not None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.ttft.observe(max(metrics.first_token_time - metrics.arrival_time, 0.0))
            if metrics.first_token_steps is not None:
                self.ttft_steps.observe(metrics.first_token_steps)
            if metrics.first_scheduled_time is not None:
                queued = metrics.first_scheduled_time - metrics.arrival_time
                self.queue_time.observe(max(queued, 0.0))
        elif previous is not None and metrics.last_token_time is not None and num_new:
            self.itl.observe(max(metrics.last_token_time - previous, 0.0))
        if metrics.last_token_time is not None:
            self._last_token_time[output.request_id] = metrics.last_token_time
        for completion in output.outputs:
            if completion.finish_reason == "timeout":
                self.request_timeout.inc()
            elif completion.finish_reason is not None:
                self._request_success_child(completion.finish_reason).inc()
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
            if metrics.finish_time is not None:
                self.e2e.observe(max(metrics.finish_time - metrics.arrival_time, 0.0))

    def _request_success_child(self, reason: str) -> Counter:
        """request_success's series for `reason`, bound on first use."""
        child = self._request_success_by_reason.get(reason)
        if child is None:
            child = self._request_success.labels(finished_reason=reason, model_name=self.model_name)
            self._request_success_by_reason[reason] = child
        return child

    def on_abort(self, request_ids: list[str]) -> None:
        self.request_abort.inc(len(request_ids))
        for request_id in request_ids:
            self._last_token_time.pop(request_id, None)

    def render(self, stats: CoreLoad, num_queued: int) -> bytes:
        """The exposition text, with the engine gauges set from `stats` first."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(num_queued)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_cached_free_perc.set(
            stats.num_kv_blocks_cached_free / max(stats.num_kv_blocks_total, 1))
        delta = stats.num_preemptions_total - self._num_preemptions_seen
        if delta > 0:
            self.num_preemptions.inc(delta)
            self._num_preemptions_seen = stats.num_preemptions_total
        return generate_latest(self.registry)
