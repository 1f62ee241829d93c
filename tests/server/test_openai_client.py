"""Acceptance 1: the official `openai` client (sync and async) and raw HTTP against a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess

PROMPT = "The three most important inventions in history are"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_text(client: openai.OpenAI) -> str:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    return result.choices[0].text


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_usage_matches_returned_tokens(client: openai.OpenAI) -> None:
    prompt_ids = [504, 3458, 282, 4649, 314]
    result = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=9, temperature=0,
                                       logprobs=0, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert result.id.startswith("cmpl-") and result.model == MODEL and result.object == "text_completion"
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 9 == len(choice.logprobs.tokens)
    assert result.usage.total_tokens == len(prompt_ids) + 9
    assert "".join(choice.logprobs.tokens) == choice.text


def test_completion_reports_cached_prompt_tokens(client: openai.OpenAI) -> None:
    system = list(range(30000, 30037))  # 37 tokens no other test sends: two full blocks of 16 and 5
    first = client.completions.create(model=MODEL, prompt=system + [504, 3458], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Another user turn after the same system prompt: its two full blocks come from the cache
    # (the third differs), in the whole response and in the streaming usage chunk alike.
    second = client.completions.create(model=MODEL, prompt=system + [282, 4649, 314], max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    chunks = list(client.completions.create(model=MODEL, prompt=[system + [7, 8, 9], system + [10]], max_tokens=2,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64  # a batch: the sum over its prompts


def test_completion_stream_equals_non_stream(client: openai.OpenAI, greedy_text: str) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == greedy_text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_truncates_with_finish_reason_stop(client: openai.OpenAI, greedy_text: str) -> None:
    words = greedy_text.split()
    stop = words[len(words) // 2]
    expected = greedy_text[: greedy_text.index(stop)]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_batch_prompts_and_n_give_indexed_choices(client: openai.OpenAI, greedy_text: str) -> None:
    result = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=24,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text == result.choices[1].text == greedy_text
    assert result.usage.completion_tokens == 4 * 24


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert result.choices[0].text.startswith(PROMPT) and len(result.choices[0].text) > len(PROMPT)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_chat_answers_and_streams_the_same(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    answer = result.choices[0].message.content
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert "Paris" in answer and result.choices[0].finish_reason == "stop"
    assert result.choices[0].message.role == "assistant"
    # The chat template's end-of-turn token counts as generated, as at OpenAI.
    assert 0 < result.usage.completion_tokens <= 30
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    streamed = chunks[-1].usage
    assert streamed is not None
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (result.usage.prompt_tokens,
                                                                     result.usage.completion_tokens)
    # The same prompt again: every full block but the one with its last token came from the
    # prefix cache (block size 16), as OpenAI reports it.
    assert streamed.prompt_tokens_details.cached_tokens == (result.usage.prompt_tokens - 1) // 16 * 16


def test_chat_n2_streams_interleaved_choices(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=12, temperature=1.0,
                                            seed=7, stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert set(finish) == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens >= 2
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=12, temperature=1.0, seed=7)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert whole.usage.completion_tokens == usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert bytes(b for entry in content for b in entry.bytes).decode() == result.choices[0].message.content


def test_async_client_concurrent_streams(server: ServerProcess, greedy_text: str) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)

        async def one() -> str:
            stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def whole() -> str:
            result = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True})
            return result.choices[0].text

        try:
            return list(await asyncio.gather(one(), one(), whole(), whole()))
        finally:
            await client.close()

    assert asyncio.run(main()) == [greedy_text] * 4


def test_raw_http_sse_framing(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1 and payloads[0]["model"] == MODEL


def test_health_is_open_and_v1_needs_the_key(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.v1 + "/models").status_code == 401
