"""Acceptance 4: clients that hang up abort their requests; running and KV usage drop to zero.

Promptness is counted in engine steps, not seconds: a hang-up is noticed by the event loop and
applied before the engine's next step, however slow a loaded machine makes each step.
"""

from __future__ import annotations

import asyncio

import httpx

from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
# Steps the engine may take between a hang-up and idle: noticing it takes the event loop a
# step or two; finishing instead would take ~1,000.
MAX_STEPS_TO_IDLE = 50


def steps(server: ServerProcess) -> float:
    return server.metrics()["backfill:engine_steps_total"]


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
    hung_up = steps(server)
    assert wait_until(lambda: engine_idle(server), timeout=60), server.metrics()
    assert steps(server) - hung_up <= MAX_STEPS_TO_IDLE
    after = server.metrics()
    assert after["backfill:request_abort_total"] - before.get("backfill:request_abort_total", 0) == 16
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_non_streaming_client_that_gives_up_is_aborted(server: ServerProcess) -> None:
    # 4,000 tokens: more steps than any machine takes in 1.5 s, so the client gives up first.
    body = {**LONG, "max_tokens": 4000, "messages": [{"role": "user", "content": "Write a very long essay about rivers."}]}
    before = server.metrics()
    try:
        httpx.post(server.v1 + "/chat/completions", json=body, headers=AUTH, timeout=1.5)
        raise AssertionError("a 4000-token completion should not finish within 1.5 s")
    except httpx.ReadTimeout:
        pass
    gave_up = steps(server)
    assert wait_until(lambda: engine_idle(server), timeout=60), server.metrics()
    assert steps(server) - gave_up <= MAX_STEPS_TO_IDLE
    assert server.metrics()["backfill:request_abort_total"] - before.get("backfill:request_abort_total", 0) == 1


def test_a_stream_failing_mid_way_ends_with_an_error_event_and_done() -> None:
    """Any failure while a stream's events are made (not only the engine's) ends the stream with
    an OpenAI error event and [DONE], never a bare end, and closes its request streams."""
    import json

    from backfill.entrypoints.openai.serving import OpenAIServing

    class Stream:
        closed = False

        def close(self) -> None:
            self.closed = True

    async def events():
        yield "data: first\n\n"
        raise KeyError("a bug")

    async def run() -> list[str]:
        return [event async for event in OpenAIServing._sse_tail(events(), [stream], None)]

    stream = Stream()
    got = asyncio.run(run())
    assert got[0] == "data: first\n\n" and got[-1] == "data: [DONE]\n\n", got
    error = json.loads(got[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"], error
    assert stream.closed
