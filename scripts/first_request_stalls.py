"""Does a server's first request of a kind stall the streams it is already sending? Starts a
fresh `backfill serve` on loopback (extra serve flags after `--`), then for each kind of request
(chat, tools, logprobs, structured output, the Responses API, ...) sends one while a long
completion streams, and prints that request's latency and the stream's longest gap between
events while it ran (a decode step is a few ms: a gap of hundreds of ms is a stall). Work a
first request does once (an import, a tokenizer's table) belongs before the server is ready.

    python scripts/first_request_stalls.py [--kinds chat,json_schema] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from backfill.bench.local_server import local_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
KINDS: dict[str, tuple[str, dict]] = {
    "json_object": ("/v1/chat/completions", {"messages": USER, "max_tokens": 10,
                                             "response_format": {"type": "json_object"}}),
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 5}),
    "json_schema": ("/v1/chat/completions", {"messages": USER, "max_tokens": 10, "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object", "properties": {"c": {"type": "integer"}}}}}}),
    "regex": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]+"}}),
    "tools": ("/v1/chat/completions", {"messages": USER, "max_tokens": 20, "tools": TOOLS}),
    "tools_required": ("/v1/chat/completions", {"messages": USER, "max_tokens": 20, "tools": TOOLS,
                                                "tool_choice": "required"}),
    "logprobs_echo": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "logprobs": 3, "echo": True}),
    "top_logprobs": ("/v1/chat/completions", {"messages": USER, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}),
    "sampling_n": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "n": 3, "seed": 1, "temperature": 0.9,
                                       "top_p": 0.9, "top_k": 5}),
    "penalties": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "presence_penalty": 1,
                                      "frequency_penalty": 1, "logit_bias": {"5": 3}}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 5}),
    "tokenize": ("/tokenize", {"prompt": "Hello world"}),
}


async def stream(client: httpx.AsyncClient, url: str, model: str, stop: asyncio.Event) -> list[float]:
    """A long completion's event times, until `stop` is set."""
    times: list[float] = []
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
            if stop.is_set():
                break
    return times


async def measure(url: str, kinds: list[str]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        print(f"{'kind':16s} status  request (ms)  longest stream gap meanwhile (ms)")
        for kind in kinds:
            path, body = KINDS[kind]
            stop = asyncio.Event()
            task = asyncio.create_task(stream(client, url, model, stop))
            await asyncio.sleep(0.5)  # the stream is decoding
            start = time.perf_counter()
            response = await client.post(url + path, json={"model": model, **body})
            end = time.perf_counter()
            await asyncio.sleep(0.2)
            stop.set()
            times = await task
            gaps = [b - a for a, b in zip(times, times[1:]) if start - 0.05 <= a <= end + 0.05]
            print(f"{kind:16s} {response.status_code:6d}  {(end - start) * 1e3:12.0f}  {max(gaps, default=0) * 1e3:10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, in order: {', '.join(KINDS)}")
    parser.add_argument("serve_flags", nargs="*", help="extra `backfill serve` flags (after --)")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds: {', '.join(unknown)}")
    with local_server(args.serve_flags) as url:
        asyncio.run(measure(url, kinds))


if __name__ == "__main__":
    main()
