"""Acceptance 5 (and issue 8's point 3): --max-queue counts what waits beyond the free slots.

With --max-num-seqs 4 and --max-queue 4, an idle server takes a burst of 8 (4 run, 4 wait) and
answers the rest 429 with Retry-After; everything accepted completes. The requests that hold
the slots ask for 2,000 tokens, so none can finish while the burst arrives: the counts do not
depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.harness import MODEL, ServerProcess, engine_idle, start_server, wait_until

MAX_NUM_SEQS = MAX_QUEUE = 4
LONG = 2000  # tokens: a request that holds its slot until the test lets go of it
ENV_KEY = "sk-from-the-environment"
AUTH = {"Authorization": f"Bearer {ENV_KEY}"}


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    # The key comes from BACKFILL_API_KEY here (the other servers take --api-key).
    process = start_server("--max-queue", str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS),
                           env={"BACKFILL_API_KEY": ENV_KEY})
    try:
        yield process
    finally:
        process.stop()


def body(index: int, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": MODEL, "prompt": f"Request {index}: the weather today is", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


async def burst(server: ServerProcess, num_requests: int) -> list[tuple[int, dict[str, str], str]]:
    """Send `num_requests` long streams at once; once every one has its status, hang them all up.

    Returns (status, headers, body) per request; a 200's body is left unread.
    """
    statuses: list[tuple[int, dict[str, str], str]] = []
    all_in = asyncio.Event()

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with client.stream("POST", server.v1 + "/completions", json=body(index, LONG, True),
                                 headers=AUTH) as response:
            text = "" if response.status_code == 200 else (await response.aread()).decode()
            statuses.append((response.status_code, dict(response.headers), text))
            if len(statuses) == num_requests:
                all_in.set()
            await all_in.wait()  # a 200 keeps its slot or queue place until every answer is in

    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_requests))), timeout=300)
    return statuses


def check_refusals(results: list[tuple[int, dict[str, str], str]]) -> None:
    for status, headers, text in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            error = json.loads(text)["error"]
            assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"


def test_api_key_from_the_environment(small_server: ServerProcess) -> None:
    assert httpx.get(small_server.v1 + "/models").status_code == 401
    assert httpx.get(small_server.v1 + "/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize("num_requests, num_refused", [(5, 0), (8, 0), (12, 4)])
def test_a_burst_on_an_idle_server_runs_4_queues_4_and_refuses_the_rest(
        small_server: ServerProcess, num_requests: int, num_refused: int) -> None:
    results = asyncio.run(burst(small_server, num_requests))
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * (num_requests - num_refused) + [429] * num_refused, statuses
    check_refusals(results)
    assert wait_until(lambda: engine_idle(small_server), timeout=30)  # hung up: all aborted
    assert httpx.get(small_server.base_url + "/health").status_code == 200


def test_queued_requests_finish_once_slots_free(small_server: ServerProcess) -> None:
    async def main() -> tuple[list[dict[str, object]], int]:
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            holders = []
            for i in range(MAX_NUM_SEQS):  # take every slot, one at a time
                stream = client.stream("POST", small_server.v1 + "/completions", json=body(i, LONG, True),
                                       headers=AUTH)
                response = await stream.__aenter__()
                assert response.status_code == 200
                lines = response.aiter_lines()  # NOTE: kept: a collected iterator closes the response
                await anext(lines)  # running: it streams
                holders.append((stream, lines))
            queued = [asyncio.create_task(client.post(small_server.v1 + "/completions", json=body(10 + i, 8, False),
                                                      headers=AUTH)) for i in range(MAX_QUEUE)]
            assert await asyncio.to_thread(
                wait_until, lambda: small_server.metrics()["backfill:num_requests_waiting"] == MAX_QUEUE, 60)
            refused = await client.post(small_server.v1 + "/completions", json=body(99, 8, False), headers=AUTH)
            check_refusals([(refused.status_code, dict(refused.headers), refused.text)])
            for stream, _ in holders:  # hang up: the queued requests take the slots
                await stream.__aexit__(None, None, None)
            answers = await asyncio.gather(*queued)
            assert [answer.status_code for answer in answers] == [200] * MAX_QUEUE
            return [answer.json() for answer in answers], refused.status_code

    before = small_server.metrics()
    answers, refused_status = asyncio.run(main())
    assert refused_status == 429
    for answer in answers:  # nothing accepted is lost or cut short
        assert answer["usage"]["completion_tokens"] == 8  # type: ignore[index]
        assert answer["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert wait_until(lambda: engine_idle(small_server), timeout=30)
    after = small_server.metrics()
    key = 'backfill:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == MAX_QUEUE
    assert httpx.get(small_server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("field", [
    {"guided_json": {"type": "integer", "maximum": 2**70}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": 2**70}}}},
])
def test_a_number_too_large_to_send_is_a_400_and_takes_no_queue_place(small_server: ServerProcess,
                                                                       field: dict[str, object]) -> None:
    # msgpack, between the server and its engine core, holds integers up to 2**64 - 1: a larger
    # one inside a schema is refused, and the refused sequences (n of them) wait nowhere.
    path = "/chat/completions" if "response_format" in field else "/completions"
    request = {"model": MODEL, "max_tokens": 2, "n": 2 * MAX_QUEUE, **field,
               **({"messages": [{"role": "user", "content": "Hi"}]} if "response_format" in field else {"prompt": "Hi"})}
    for _ in range(3):
        response = httpx.post(small_server.v1 + path, json=request, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "out of range" in error["message"], error
    assert small_server.metrics()["backfill:num_requests_waiting"] == 0
    answer = httpx.post(small_server.v1 + "/completions", json=body(0, 2, False), headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
