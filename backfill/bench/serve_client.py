"""Load client: replays a workload against any OpenAI-compatible `/v1/completions` endpoint.

Streams every request (SSE) with `ignore_eos`, so output lengths are what the workload asks,
and times each token event on arrival. The output token count comes from the `usage` of the
final chunk (`stream_options.include_usage`); servers that send none fall back to counting
chunks that carried text. Knows nothing of backfill's internals: it measures vLLM or
llama.cpp's `llama-server` the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
from tqdm import tqdm

from backfill.bench.metrics import RequestResult, summarize
from backfill.bench.workloads import WorkloadRequest, at_rate

logger = logging.getLogger(__name__)

GENERATION_TOKENS_SUFFIX = "generation_tokens_total"
PREFIX_QUERIES_SUFFIX = "prefix_cache_queries_total"
PREFIX_HITS_SUFFIX = "prefix_cache_hits_total"
COUNTER_SUFFIXES = (GENERATION_TOKENS_SUFFIX, PREFIX_QUERIES_SUFFIX, PREFIX_HITS_SUFFIX)


@dataclass(frozen=True)
class ServeBenchConfig:
    """How to replay a workload. `request_rate=None` keeps the workload's own arrival times."""

    base_url: str
    model: str | None = None  # None: the first id from GET /v1/models
    endpoint: str = "/v1/completions"
    request_rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 6 * 3600.0
    num_warmups: int = 1  # requests sent (and not measured) before the run checks the endpoint
    show_progress: bool = True


@dataclass
class _StreamState:
    token_times: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int = 0


def request_headers(config: ServeBenchConfig) -> dict[str, str]:
    """The headers of every request to the server (its API key, when it has one)."""
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


def build_payload(request: WorkloadRequest, model: str, config: ServeBenchConfig) -> dict[str, Any]:
    """The /v1/completions body for one request (token-id prompts go as a list of ints)."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt if request.prompt is not None else request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _consume_event(data: str, state: _StreamState, now: float) -> None:
    """Apply one SSE `data:` payload to `state`. Raises on an error object."""
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        raise RuntimeError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
    choices = chunk.get("choices") or []
    if choices:
        choice = choices[0]
        text = choice.get("text") or ""
        # A final chunk that only carries finish_reason is a marker, not a token event.
        if text or choice.get("finish_reason") is None:
            state.token_times.append(now)
            state.text_parts.append(text)
    usage = chunk.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            state.usage_completion_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            state.usage_prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            state.usage_cached_tokens = int(details["cached_tokens"])


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    request: WorkloadRequest,
    model: str,
    config: ServeBenchConfig,
    progress: tqdm | None = None,
) -> RequestResult:
    """Send one streaming completion; never raises: a failure is a result with `error` set."""
    expected = request.max_tokens
    prompt_len = len(request.prompt_token_ids) if request.prompt_token_ids is not None else 0
    state = _StreamState()
    start = time.perf_counter()
    try:
        async with session.post(url, json=build_payload(request, model, config), headers=request_headers(config)) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                raise RuntimeError(f"HTTP {response.status}: {body}")
            # NOTE: iterating a StreamReader yields whole lines; SSE events are `data: ...`
            # lines separated by blank ones, and `:` lines are comments (keep-alives).
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip().decode("utf-8")
                if data == "[DONE]":
                    break
                _consume_event(data, state, time.perf_counter())
        if not state.token_times:
            raise RuntimeError("the stream carried no tokens")
        output_len = (
            state.usage_completion_tokens if state.usage_completion_tokens is not None else len(state.token_times)
        )
        result = RequestResult(
            success=True,
            prompt_len=state.usage_prompt_tokens if state.usage_prompt_tokens is not None else prompt_len,
            cached_len=state.usage_cached_tokens,
            output_len=output_len,
            expected_output_len=expected,
            start_time=start,
            ttft=state.token_times[0] - start,
            itl=[b - a for a, b in zip(state.token_times, state.token_times[1:])],
            latency=state.token_times[-1] - start,
            generated_text="".join(state.text_parts),
        )
    except Exception as error:  # noqa: BLE001 - any failure of one request is recorded, not fatal
        result = RequestResult(
            success=False, prompt_len=prompt_len, expected_output_len=expected, start_time=start,
            latency=time.perf_counter() - start, error=f"{type(error).__name__}: {error}",
        )
    if progress is not None:
        progress.update(1)
    return result


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str, config: ServeBenchConfig) -> str:
    """The first model the server lists; "default" when it lists none (llama-server accepts any)."""
    try:
        async with session.get(base_url + "/v1/models", headers=request_headers(config)) as response:
            if response.status == 200:
                data = await response.json()
                models = data.get("data") or []
                if models:
                    return str(models[0]["id"])
    except (aiohttp.ClientError, ValueError, KeyError) as error:
        logger.warning("GET /v1/models failed (%s); sending model 'default'", error)
    return "default"


def parse_generation_tokens_total(metrics_text: str) -> float | None:
    """Sum of every Prometheus sample named `*generation_tokens_total` (vLLM, backfill, ...)."""
    return parse_counter_total(metrics_text, GENERATION_TOKENS_SUFFIX)


def parse_counter_total(metrics_text: str, suffix: str) -> float | None:
    """Sum of every Prometheus sample whose name ends with `suffix` (None: no such sample)."""
    total: float | None = None
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith(suffix):
            try:
                total = (total or 0.0) + float(value)
            except ValueError:
                continue
    return total


async def fetch_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, float | None]:
    """The server's counters in COUNTER_SUFFIXES from /metrics (None: it has no such counter)."""
    text = ""
    try:
        async with session.get(base_url + "/metrics") as response:
            if response.status == 200:
                text = await response.text()
    except aiohttp.ClientError:
        pass
    return {suffix: parse_counter_total(text, suffix) for suffix in COUNTER_SUFFIXES}


def schedule_arrivals(requests: list[WorkloadRequest], config: ServeBenchConfig) -> list[WorkloadRequest]:
    """Apply `config.request_rate` (seeded Poisson / gamma), or keep the workload's own times."""
    if config.request_rate is None:
        return requests
    return at_rate(requests, config.request_rate, config.burstiness, config.seed)


async def benchmark_serve(requests: list[WorkloadRequest], config: ServeBenchConfig) -> dict[str, Any]:
    """Replay `requests` and return the vLLM-style result dict (see metrics.summarize).

    Adds `server_generation_tokens_delta` (None when the server has no such counter): the
    change of the server's own count over the measured run, to check ours against.
    """
    base_url = config.base_url.rstrip("/")
    url = base_url + config.endpoint
    scheduled = schedule_arrivals(requests, config)
    order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].arrival_s)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    # No client-side cap on concurrency. NOTE: force_close gives each request its own
    # connection: reusing an idle keep-alive connection races with the server closing it
    # (uvicorn closes after 5 s idle), which fails the request before it is sent.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await fetch_model_id(session, base_url, config)
        for _ in range(config.num_warmups):
            first = scheduled[order[0]]
            probe = WorkloadRequest(min(first.max_tokens, 4), first.prompt, first.prompt_token_ids)
            warm = await send_request(session, url, probe, model, config)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        counters_before = await fetch_counters(session, base_url)
        progress = tqdm(total=len(scheduled), desc="bench serve", disable=not config.show_progress)
        tasks: list[asyncio.Task[RequestResult]] = [None] * len(scheduled)  # type: ignore[list-item]
        run_start = time.perf_counter()
        for index in order:
            request = scheduled[index]
            delay = run_start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks[index] = asyncio.create_task(send_request(session, url, request, model, config, progress))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_start
        progress.close()
        counters_after = await fetch_counters(session, base_url)
    summary = summarize(results, duration, config.goodput_slo_ms or None, config.percentiles)
    summary["start_times"] = [r.start_time - run_start for r in results]  # s after the run began
    mismatched = summary["num_output_len_mismatch"]
    if mismatched:
        logger.warning("%d request(s) received a different number of tokens than asked", mismatched)
    deltas = {suffix: None if counters_before[suffix] is None or counters_after[suffix] is None
              else counters_after[suffix] - counters_before[suffix]  # type: ignore[operator]
              for suffix in COUNTER_SUFFIXES}
    queries, hits = deltas[PREFIX_QUERIES_SUFFIX], deltas[PREFIX_HITS_SUFFIX]
    rate = config.request_rate
    header: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "base_url": base_url,
        "endpoint": config.endpoint,
        "model_id": model,
        "num_prompts": len(scheduled),
        "request_rate": "workload" if rate is None else ("inf" if math.isinf(rate) else rate),
        "burstiness": config.burstiness,
        "max_concurrency": None,
        "server_generation_tokens_delta": deltas[GENERATION_TOKENS_SUFFIX],
        # The server's own prefix cache counters over the measured run (vLLM's names too), to
        # check `prefix_cache_hit_rate` (from the responses' usage) against.
        "server_prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
    }
    return {**header, **summary}


def run_serve_benchmark(requests: list[WorkloadRequest], config: ServeBenchConfig) -> dict[str, Any]:
    """Synchronous wrapper for the CLI."""
    return asyncio.run(benchmark_serve(requests, config))
