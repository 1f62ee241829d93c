"""Acceptance 4: clients that hang up abort their requests; running and KV usage drop to zero."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


async def _hang_up_mid_stream(server: ServerProcess, index: int) -> int:
    body = {**LONG, "prompt": f"Story number {index}: once upon a time", "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", server.v1 + "/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            received = 0
            async for line in response.aiter_lines():
                received += line.startswith("data: ")
                if received >= 3:
                    break
    return received  # leaving both contexts closes the connection mid-stream


def test_streaming_clients_that_hang_up_free_everything(server: ServerProcess) -> None:
    before = server.metrics()

    async def main() -> list[int]:
        return list(await asyncio.gather(*(_hang_up_mid_stream(server, i) for i in range(16))))

    assert asyncio.run(main()) == [3] * 16
    hung_up = time.monotonic()
    assert wait_until(lambda: engine_idle(server), timeout=2.0), server.metrics()
    assert time.monotonic() - hung_up < 2.5
    after = server.metrics()
    assert after["backfill:request_abort_total"] - before.get("backfill:request_abort_total", 0) == 16
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_non_streaming_client_that_gives_up_is_aborted(server: ServerProcess) -> None:
    body = {**LONG, "prompt": "Write a very long essay about rivers."}
    try:
        httpx.post(server.v1 + "/chat/completions", json={**body, "messages": [{"role": "user", "content": body["prompt"]}]},
                   headers=AUTH, timeout=1.5)
        raise AssertionError("a 1000-token completion should not finish within 1.5 s")
    except httpx.ReadTimeout:
        pass
    assert wait_until(lambda: engine_idle(server), timeout=2.0), server.metrics()
