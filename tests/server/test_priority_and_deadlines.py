"""Acceptance 3 and 4: priorities preempt for a better priority, measured in engine steps; deadlines
end requests with a 408 `request_timeout` (streaming and not), and leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.harness import API_KEY, ServerProcess, engine_idle, start_server, wait_until

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
STEPS_BUCKET = 'backfill:time_to_first_token_steps_bucket{le="2.0"}'


@pytest.fixture(scope="module")
def priority_server() -> Iterator[ServerProcess]:
    # No prefill budget: a short prompt always runs in one step beside the decodes.
    process = start_server("--api-key", API_KEY, "--scheduling-policy", "priority", "--max-num-seqs", "4",
                           "--prefill-budget", "0")
    try:
        yield process
    finally:
        process.stop()
    assert "Traceback" not in process.log(), process.log()[-4000:]


def _body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}


def test_priority_zero_preempts_a_flood_of_priority_ten(priority_server: ServerProcess) -> None:
    """4 slots, 10 priority-10 requests, then 4 priority-0 ones: each priority-0 request gets its
    first token within two engine steps of its arrival at the core (it preempts a priority-10
    one: a slot is free for it at once), counted by the core in steps, so a slow machine cannot
    make it flake. Every request still completes with all its tokens."""
    server = priority_server
    num_flood, num_vip = 10, 4

    async def run() -> tuple[list[httpx.Response], list[httpx.Response], dict[str, float], dict[str, float]]:
        async with httpx.AsyncClient(base_url=server.v1, headers=HEADERS, timeout=600) as client:
            flood = [asyncio.create_task(client.post("/completions", json=_body(48, priority=10)))
                     for _ in range(num_flood)]
            # Every flood request is in, and the waiting ones have waited more than two steps: the
            # only first tokens within two steps from now on are the priority-0 requests'.
            await asyncio.to_thread(wait_until, lambda: _load(server) == num_flood, 120)
            start = server.metrics()["backfill:engine_steps_total"]
            await asyncio.to_thread(
                wait_until, lambda: server.metrics()["backfill:engine_steps_total"] >= start + 4, 120)
            before = server.metrics()
            assert before["backfill:num_requests_running"] == 4 and before["backfill:num_requests_waiting"] == 6
            vips = await asyncio.gather(*(client.post("/completions", json=_body(8, priority=0))
                                          for _ in range(num_vip)))
            after = server.metrics()
            return list(await asyncio.gather(*flood)), list(vips), before, after

    flood, vips, before, after = asyncio.run(run())
    for response, max_tokens in [(r, 48) for r in flood] + [(r, 8) for r in vips]:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == max_tokens and body["choices"][0]["finish_reason"] == "length"
    assert after[STEPS_BUCKET] - before[STEPS_BUCKET] == num_vip
    assert after["backfill:num_preemptions_total"] - before["backfill:num_preemptions_total"] >= num_vip
    assert wait_until(lambda: engine_idle(server), timeout=60)


def _load(server: ServerProcess) -> float:
    samples = server.metrics()
    return samples["backfill:num_requests_running"] + samples["backfill:num_requests_waiting"]


@pytest.mark.parametrize("body, param", [
    ({"priority": 1001}, "priority"), ({"priority": "1"}, "priority"), ({"priority": 1.5}, "priority"),
    ({"request_timeout": 0}, "request_timeout"), ({"request_timeout": -1}, "request_timeout"),
    ({"request_timeout": "1"}, "request_timeout"),
])
def test_bad_priority_and_timeout_values_are_400s(priority_server: ServerProcess, body: dict[str, Any],
                                                  param: str) -> None:
    response = httpx.post(priority_server.v1 + "/completions", headers=HEADERS, json={**_body(1), **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_fcfs_refuses_a_priority(server: ServerProcess) -> None:
    response = httpx.post(server.v1 + "/completions", headers=HEADERS, json=_body(1, priority=-3))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert httpx.post(server.v1 + "/completions", headers=HEADERS, json=_body(1, priority=0)).status_code == 200


# ---- deadlines ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy_server() -> Iterator[ServerProcess]:
    process = start_server("--api-key", API_KEY, "--max-num-seqs", "8", "--request-timeout", "600")
    try:
        yield process
    finally:
        process.stop()
    assert "Traceback" not in process.log(), process.log()[-4000:]


def _max_step_s(before: dict[str, float], after: dict[str, float]) -> float:
    """An upper bound on the longest step between two scrapes: the lowest bucket holding them all."""
    total = after["backfill:engine_step_duration_seconds_count"] - before["backfill:engine_step_duration_seconds_count"]
    bounds = sorted(float(key.split('le="')[1].rstrip('"}')) for key in after
                    if key.startswith("backfill:engine_step_duration_seconds_bucket"))
    for bound in bounds:
        key = f'backfill:engine_step_duration_seconds_bucket{{le="{bound}"}}'
        if bound != float("inf") and after[key] - before.get(key, 0.0) >= total:
            return bound
    return float("inf")


def test_32_requests_with_a_one_second_timeout_end_by_their_deadline(busy_server: ServerProcess) -> None:
    """4 long requests keep the server busy; 32 requests with request_timeout 1 s (half of them
    streaming) each end with the 408 `request_timeout` error within their deadline plus one step
    (the longest step the server reports, plus transport slack on a loaded machine); afterwards
    nothing runs and the KV pool is empty."""
    server = busy_server
    timeout_s = 1.0
    slack_s = 1.0  # HTTP and the client's own scheduling on a loaded machine

    async def one(client: httpx.AsyncClient, stream: bool) -> tuple[float, Any]:
        start = time.monotonic()
        body = _body(1500, request_timeout=timeout_s, stream=stream)
        if not stream:
            response = await client.post("/completions", json=body)
            return time.monotonic() - start, (response.status_code, response.json())
        events = []
        async with client.stream("POST", "/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        return time.monotonic() - start, events

    async def run() -> tuple[list[tuple[float, Any]], dict[str, float], dict[str, float]]:
        async with httpx.AsyncClient(base_url=server.v1, headers=HEADERS, timeout=600) as client:
            busy = [asyncio.create_task(client.post("/completions", json=_body(1500))) for _ in range(4)]
            await asyncio.to_thread(wait_until, lambda: server.metrics()["backfill:num_requests_running"] == 4, 120)
            before = server.metrics()
            results = await asyncio.gather(*(one(client, stream=i % 2 == 1) for i in range(32)))
            after = server.metrics()
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return list(results), before, after

    results, before, after = asyncio.run(run())
    max_step_s = _max_step_s(before, after)
    for i, (elapsed, result) in enumerate(results):
        assert elapsed <= timeout_s + max_step_s + slack_s, (i, elapsed, max_step_s)
        if i % 2 == 0:
            status, body = result
            assert status == 408, body
            assert body["error"]["code"] == "request_timeout" and body["error"]["param"] == "request_timeout"
        else:
            assert result[-1] == "[DONE]"
            error = json.loads(result[-2])["error"]
            assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
            assert all("error" not in json.loads(event) for event in result[:-2])
    assert after["backfill:request_timeout_total"] - before["backfill:request_timeout_total"] == 32
    assert wait_until(lambda: engine_idle(server), timeout=60)
    samples = server.metrics()
    assert samples["backfill:num_requests_running"] == 0 and samples["backfill:kv_cache_usage_perc"] == 0


def test_chat_completions_take_priority_and_request_timeout(busy_server: ServerProcess,
                                                            server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
            "ignore_eos": True, "request_timeout": 0.5}
    response = httpx.post(busy_server.v1 + "/chat/completions", headers=HEADERS, json=body, timeout=120)
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", busy_server.v1 + "/chat/completions", headers=HEADERS, json={**body, "stream": True},
                      timeout=120) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    refused = httpx.post(server.v1 + "/chat/completions", headers=HEADERS, json={**body, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert wait_until(lambda: engine_idle(busy_server), timeout=60)
