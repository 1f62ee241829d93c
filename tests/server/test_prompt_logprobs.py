"""Prompt logprobs through the server: the legacy `echo` + `logprobs` form that evaluation
harnesses send to /v1/completions (lm-evaluation-harness's loglikelihood requests: echo,
logprobs, max_tokens 1 or 0), whole and streamed, and vLLM's `prompt_logprobs` field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backfill.tokenizer import load_tokenizer
from tests.server.harness import API_KEY, MODEL, ServerProcess

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.v1 + path, json={"model": MODEL, **body}, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_echo_with_logprobs_scores_the_prompt_and_the_answer(client: openai.OpenAI, server: ServerProcess) -> None:
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2,
                                       temperature=0)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=2, temperature=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert lp is not None and scored.usage is not None
    num_prompt = scored.usage.prompt_tokens
    assert choice.text == PROMPT + plain.choices[0].text and "".join(lp.tokens or []) == choice.text
    assert len(lp.tokens or []) == len(lp.token_logprobs or []) == len(lp.top_logprobs or []) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[index]
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(num_prompt + 1)]
    assert all(isinstance(value, float) and value <= 0 for value in (lp.token_logprobs or [])[1:])
    assert all(len(top) >= 1 for top in (lp.top_logprobs or [])[1:])  # type: ignore[arg-type]
    # The answer's entry is the plain request's; the prompt's are vLLM's prompt_logprobs field's.
    assert (lp.token_logprobs or [])[-1] == (plain.choices[0].logprobs.token_logprobs or [])[0]  # type: ignore[union-attr]
    field = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    entries = field["choices"][0]["prompt_logprobs"]
    assert len(entries) == num_prompt and entries[0] is None
    for entry, value in zip(entries[1:], (lp.token_logprobs or [])[1:num_prompt]):
        own = [item for item in entry.values() if item["logprob"] == value]
        assert own and all(item["rank"] >= 1 for item in entry.values()) and 2 <= len(entry) <= 3


def test_max_tokens_zero_with_echo_is_the_prompt_alone(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello there"], max_tokens=0, echo=True,
                                       logprobs=0, temperature=0)
    assert [choice.text for choice in result.choices] == [PROMPT, "Hello there"]
    assert all(choice.finish_reason == "length" for choice in result.choices)
    assert result.usage is not None and result.usage.completion_tokens == 0
    lengths = [len(choice.logprobs.tokens or []) for choice in result.choices]  # type: ignore[union-attr]
    assert sum(lengths) == result.usage.prompt_tokens


def test_streamed_echo_with_logprobs_assembles_to_the_whole(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, n=2,
                                  temperature=0.8, seed=3)
    whole = client.completions.create(**fields).choices
    text, tokens, values = ["", ""], [[], []], [[], []]  # type: ignore[var-annotated]
    for chunk in client.completions.create(stream=True, **fields):
        choice = chunk.choices[0]
        text[choice.index] += choice.text
        if choice.logprobs is not None:
            tokens[choice.index] += choice.logprobs.tokens or []
            values[choice.index] += choice.logprobs.token_logprobs or []
    for index, choice in enumerate(whole):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs[0] is None  # type: ignore[index]
        assert text[index] == choice.text and tokens[index] == choice.logprobs.tokens
        assert values[index] == choice.logprobs.token_logprobs


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    first, again = post(server, "/chat/completions", body), post(server, "/chat/completions", body)
    entries = first["prompt_logprobs"]
    assert len(entries) == first["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in entries[1:])
    assert again["prompt_logprobs"] == entries  # not served from the prefix cache: all computed again
    assert post(server, "/chat/completions", {**body, "prompt_logprobs": None})["prompt_logprobs"] is None


def test_lm_evaluation_harness_scores_through_the_server(server: ServerProcess, tmp_path: Path) -> None:
    """lm-evaluation-harness's own API client (`local-completions`), unchanged: its
    loglikelihood requests (token ids, echo, logprobs 1, max_tokens 1) and its parsing of the
    answers give each continuation's summed logprob, the same as the server's prompt_logprobs."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    load_tokenizer(None).hf.save_pretrained(tmp_path)  # the served model's tokenizer, for the client
    model = LocalCompletionsAPI(base_url=server.v1 + "/completions", model=MODEL, tokenizer_backend="huggingface",
                                tokenizer=str(tmp_path), num_concurrent=2, max_retries=1, batch_size=3,
                                header={"Authorization": f"Bearer {API_KEY}"})
    pairs = [(PROMPT, " Paris"), (PROMPT, " Berlin"), ("The sky is", " blue"), ("2 + 2 =", " 4")]
    scored = model.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                                  for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, _) in zip(pairs, scored):
        num_context = len(model.tok_encode(context))
        body = {"prompt": model.tok_encode(context + continuation), "max_tokens": 1, "prompt_logprobs": 0}
        entries = post(server, "/completions", body)["choices"][0]["prompt_logprobs"][num_context:]
        assert logprob == pytest.approx(sum(next(iter(entry.values()))["logprob"] for entry in entries), abs=1e-9)
    (paris, paris_greedy), (berlin, berlin_greedy) = scored[:2]
    assert paris > berlin and paris_greedy and not berlin_greedy  # the model's answer is Paris (greedy)
    [text] = model.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                            arguments=(PROMPT, {"until": ["\n"], "max_gen_toks": 8}))])
    assert text.startswith(" Paris")
