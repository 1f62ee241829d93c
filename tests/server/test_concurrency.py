"""Acceptance 2: 64 concurrent streams with mixed lengths equal the offline engine, and count."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from backfill.engine.llm import LLM
from backfill.sampling_params import SamplingParams
from tests.prompts import TOPICS
from tests.server.harness import (API_KEY, MODEL, NUM_KV_BLOCKS, NUM_THREADS, ServerProcess, engine_idle,
                                  wait_until)

NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def workload() -> tuple[list[str], list[int]]:
    # Short prompts keep prefill cheap on a CPU; lengths mixed from 1 to 32 tokens.
    rng = random.Random(2)
    prompts = [f"{i}. {TOPICS[i % len(TOPICS)]}, in {['one', 'two', 'three'][i % 3]} sentences:"
               for i in range(NUM_REQUESTS)]
    return prompts, [rng.randint(1, 32) for _ in range(NUM_REQUESTS)]


async def _stream_all(server: ServerProcess, prompts: list[str], max_tokens: list[int]) -> list[dict[str, object]]:
    client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)

    async def one(prompt: str, limit: int) -> dict[str, object]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=limit, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return {"text": text, "finish_reason": finish, "usage": usage}

    try:
        return list(await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens))))
    finally:
        await client.close()


def test_64_concurrent_streams_equal_offline_generate(server: ServerProcess, workload: tuple[list[str], list[int]]) -> None:
    prompts, max_tokens = workload
    before = server.metrics()
    results = asyncio.run(_stream_all(server, prompts, max_tokens))
    assert wait_until(lambda: engine_idle(server), timeout=60)
    after = server.metrics()

    llm = LLM(dtype="float32", max_num_seqs=32, num_kv_blocks=NUM_KV_BLOCKS, num_threads=NUM_THREADS)
    expected = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    for i, (result, offline) in enumerate(zip(results, expected)):
        assert result["text"] == offline.text, f"request {i} differs from LLM.generate"
        assert result["finish_reason"] == offline.finish_reason
        usage = result["usage"]
        assert usage.completion_tokens == len(offline.token_ids) <= max_tokens[i]
        assert usage.prompt_tokens == len(offline.prompt_token_ids)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = sum(delta(f'backfill:request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length"))
    assert finished == NUM_REQUESTS
    assert delta("backfill:generation_tokens_total") == sum(r["usage"].completion_tokens for r in results)
    assert delta("backfill:prompt_tokens_total") == sum(r["usage"].prompt_tokens for r in results)
    assert delta("backfill:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert delta("backfill:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert delta("backfill:engine_steps_total") > 0
    # Continuous batching: no slot is ever held idle by a finished request.
    assert delta("backfill:batch_slot_steps_idle_total") == 0
    assert delta("backfill:batch_slot_steps_used_total") >= sum(r["usage"].completion_tokens for r in results) / 2
