"""Acceptance 5: a burst over --max-queue gets 429 + Retry-After; everything accepted completes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.harness import MODEL, ServerProcess, engine_idle, start_server, wait_until

BURST = 64
MAX_TOKENS = 8
ENV_KEY = "sk-from-the-environment"
AUTH = {"Authorization": f"Bearer {ENV_KEY}"}


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    # The key comes from BACKFILL_API_KEY here (the other servers take --api-key).
    process = start_server("--max-queue", "4", "--max-num-seqs", "4", env={"BACKFILL_API_KEY": ENV_KEY})
    try:
        yield process
    finally:
        process.stop()


async def _one(client: httpx.AsyncClient, server: ServerProcess, index: int) -> tuple[int, dict[str, str], object]:
    body = {"model": MODEL, "prompt": f"Request {index}: the weather today is", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": index % 2 == 1}
    async with client.stream("POST", server.v1 + "/completions", json=body, headers=AUTH) as response:
        raw = (await response.aread()).decode()
    if response.status_code != 200:
        return response.status_code, dict(response.headers), json.loads(raw)
    if body["stream"]:
        events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        return 200, dict(response.headers), {"text": text, "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}
    result = json.loads(raw)
    assert result["usage"]["completion_tokens"] == MAX_TOKENS
    return 200, dict(response.headers), result["choices"][0]


def test_api_key_from_the_environment(small_server: ServerProcess) -> None:
    assert httpx.get(small_server.v1 + "/models").status_code == 401
    assert httpx.get(small_server.v1 + "/models", headers=AUTH).status_code == 200


def test_burst_over_the_queue_limit(small_server: ServerProcess) -> None:
    async def main() -> list[tuple[int, dict[str, str], object]]:
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.wait_for(
                asyncio.gather(*(_one(client, small_server, i) for i in range(BURST))), timeout=300))

    results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    accepted = [body for status, _, body in results if status == 200]
    rejected = [(headers, body) for status, headers, body in results if status == 429]
    assert len(accepted) >= 4 and rejected, statuses
    for headers, body in rejected:
        assert int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == "queue_full"
    for choice in accepted:  # nothing accepted is lost or cut short
        assert choice["finish_reason"] == "length" and choice["text"]
    assert wait_until(lambda: engine_idle(small_server), timeout=5)
    samples = small_server.metrics()
    assert samples['backfill:request_success_total{finished_reason="length"}'] == len(accepted)
    assert httpx.get(small_server.base_url + "/health").status_code == 200
