"""A tiny OpenAI-compatible streaming server for testing the load client (aiohttp, in a thread)."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeServerState:
    token_delay_s: float = 0.002
    send_usage: bool = True
    fail_every: int = 0  # every n-th completion answers 500 (0: never)
    short_by: int = 0  # send this many tokens fewer than asked (to test the length check)
    generation_tokens_total: int = 0
    # a fake prefix cache: the first half of every prompt (rounded down) is "cached"
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=list)
    max_in_flight: int = 0
    in_flight: int = 0


def make_app(state: FakeServerState) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        text = (
            "# HELP fake:generation_tokens_total Generated tokens.\n"
            "# TYPE fake:generation_tokens_total counter\n"
            f'fake:generation_tokens_total{{model_name="fake-model"}} {float(state.generation_tokens_total)}\n'
            f"fake:generation_tokens_created 1.7e9\n"
            f'fake:prefix_cache_queries_total{{model_name="fake-model"}} {float(state.prefix_cache_queries_total)}\n'
            f'fake:prefix_cache_hits_total{{model_name="fake-model"}} {float(state.prefix_cache_hits_total)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def completions(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        state.payloads.append(payload)
        if state.fail_every and len(state.payloads) % state.fail_every == 0:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        n = max(int(payload["max_tokens"]) - state.short_by, 1)
        prompt = payload["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        cached_tokens = prompt_tokens // 2
        state.prefix_cache_queries_total += prompt_tokens
        state.prefix_cache_hits_total += cached_tokens
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            for i in range(n):
                await asyncio.sleep(state.token_delay_s)
                state.generation_tokens_total += 1
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": "fake-model",
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            await response.write(f"data: {json.dumps(final)}\n\n".encode())
            if state.send_usage and payload.get("stream_options", {}).get("include_usage"):
                usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                   "total_tokens": prompt_tokens + n,
                                                   "prompt_tokens_details": {"cached_tokens": cached_tokens}}}
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        finally:
            state.in_flight -= 1
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


class FakeServer:
    """Runs `make_app` on 127.0.0.1 (a free port) in a daemon thread; `base_url` once started."""

    def __init__(self, state: FakeServerState) -> None:
        self.state = state
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(make_app(self.state))
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._started.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
