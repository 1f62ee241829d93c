"""Acceptance 3: every kind of invalid request gets the right OpenAI error, and harms nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 8192
CHAT = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


C, CH = "/v1/completions", "/v1/chat/completions"
INVALID = "invalid_request_error"

# (case id, method, path, body: dict or raw bytes, headers, status, error type, param)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str, str | None]] = [
    ("malformed-json", "POST", C, b'{"model": "x", "prompt": ', AUTH, 400, INVALID, None),
    ("body-not-object", "POST", C, b"[1, 2]", AUTH, 400, INVALID, None),
    ("empty-body", "POST", C, b"", AUTH, 400, INVALID, None),
    ("missing-prompt", "POST", C, {"model": MODEL}, AUTH, 400, INVALID, "prompt"),
    ("empty-prompt", "POST", C, completion(prompt=""), AUTH, 400, INVALID, "prompt"),
    ("prompt-wrong-type", "POST", C, completion(prompt=5), AUTH, 400, INVALID, "prompt"),
    ("prompt-mixed-list", "POST", C, completion(prompt=[1, "a"]), AUTH, 400, INVALID, "prompt"),
    ("token-out-of-vocab", "POST", C, completion(prompt=[1, 10_000_000]), AUTH, 400, INVALID, "prompt"),
    ("token-negative", "POST", C, completion(prompt=[[3, -1]]), AUTH, 400, INVALID, "prompt"),
    ("max-tokens-string", "POST", C, completion(max_tokens="10"), AUTH, 400, INVALID, "max_tokens"),
    ("max-tokens-bool", "POST", C, completion(max_tokens=True), AUTH, 400, INVALID, "max_tokens"),
    ("max-tokens-zero", "POST", C, completion(max_tokens=0), AUTH, 400, INVALID, "max_tokens"),
    ("temperature-negative", "POST", C, completion(temperature=-0.5), AUTH, 400, INVALID, "temperature"),
    ("temperature-too-high", "POST", C, completion(temperature=2.5), AUTH, 400, INVALID, "temperature"),
    ("top-p-zero", "POST", C, completion(top_p=0), AUTH, 400, INVALID, "top_p"),
    ("n-zero", "POST", C, completion(n=0), AUTH, 400, INVALID, "n"),
    ("n-huge", "POST", C, completion(n=10_000), AUTH, 400, INVALID, "n"),
    ("logprobs-too-many", "POST", C, completion(logprobs=6), AUTH, 400, INVALID, "logprobs"),
    ("presence-penalty-range", "POST", C, completion(presence_penalty=3), AUTH, 400, INVALID, "presence_penalty"),
    ("frequency-penalty-type", "POST", C, completion(frequency_penalty="a"), AUTH, 400, INVALID, "frequency_penalty"),
    ("stop-empty-string", "POST", C, completion(stop=[""]), AUTH, 400, INVALID, "stop"),
    ("stop-wrong-type", "POST", C, completion(stop=5), AUTH, 400, INVALID, "stop"),
    ("logit-bias-key", "POST", C, completion(logit_bias={"abc": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-token-range", "POST", C, completion(logit_bias={"99999999": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-value", "POST", C, completion(logit_bias={"5": 500}), AUTH, 400, INVALID, "logit_bias"),
    # Keys that pass str.isdigit() or int() but are not plain ASCII token ids (int() raised: a 500).
    ("logit-bias-double-minus", "POST", C, completion(logit_bias={"--5": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-superscript", "POST", C, completion(logit_bias={"²": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-arabic-digit", "POST", CH, chat(logit_bias={"٣": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-negative", "POST", C, completion(logit_bias={"-5": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-padded", "POST", C, completion(logit_bias={" 5": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-underscore", "POST", C, completion(logit_bias={"1_0": 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-5000-digits", "POST", C, completion(logit_bias={"9" * 5000: 1}), AUTH, 400, INVALID, "logit_bias"),
    ("logit-bias-nan", "POST", C, b'{"prompt": "Hello", "max_tokens": 2, "logit_bias": {"5": NaN}}', AUTH, 400, INVALID, "logit_bias"),
    ("temperature-nan", "POST", C, b'{"prompt": "Hello", "max_tokens": 2, "temperature": NaN}', AUTH, 400, INVALID, "temperature"),
    ("top-p-infinity", "POST", CH, b'{"messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}', AUTH, 400, INVALID, "top_p"),
    ("seed-wrong-type", "POST", C, completion(seed="x"), AUTH, 400, INVALID, "seed"),
    ("user-wrong-type", "POST", C, completion(user=5), AUTH, 400, INVALID, "user"),
    ("top-k-range", "POST", C, completion(top_k=-5), AUTH, 400, INVALID, "top_k"),
    ("min-p-range", "POST", C, completion(min_p=2), AUTH, 400, INVALID, "min_p"),
    ("repetition-penalty-zero", "POST", C, completion(repetition_penalty=0), AUTH, 400, INVALID, "repetition_penalty"),
    ("min-tokens-over-max", "POST", C, completion(min_tokens=10), AUTH, 400, INVALID, "min_tokens"),
    ("stop-token-ids-negative", "POST", C, completion(stop_token_ids=[-1]), AUTH, 400, INVALID, "stop_token_ids"),
    ("stop-token-ids-out-of-vocab", "POST", C, completion(stop_token_ids=[10**12]), AUTH, 400, INVALID, "stop_token_ids"),
    # min_tokens holds off EOS: more than the context leaves would run to the full context.
    ("min-tokens-over-context-chat", "POST", CH, {"model": MODEL, "messages": CHAT, "min_tokens": 10**9}, AUTH, 400, INVALID, "min_tokens"),
    ("min-tokens-over-context", "POST", C, completion(max_tokens=None, min_tokens=CONTEXT), AUTH, 400, INVALID, "min_tokens"),
    # Fan-out: prompts x n over --max-seqs-per-request (256), refused before tokenizing.
    ("fan-out-issue-probe", "POST", C, completion(prompt=[[1]] * 4000, n=128, max_tokens=1), AUTH, 400, INVALID, "prompt"),
    ("fan-out-prompt-strings", "POST", C, completion(prompt=["Hi"] * 257), AUTH, 400, INVALID, "prompt"),
    ("fan-out-prompts-times-n", "POST", C, completion(prompt=[[1, 2]] * 3, n=128), AUTH, 400, INVALID, "n"),
    ("fan-out-strings-times-n", "POST", C, completion(prompt=["Hi", "Ho", "Ha"], n=100), AUTH, 400, INVALID, "n"),
    ("n-over-128-chat", "POST", CH, chat(n=129), AUTH, 400, INVALID, "n"),
    ("ignore-eos-type", "POST", C, completion(ignore_eos="yes"), AUTH, 400, INVALID, "ignore_eos"),
    ("prompt-over-context", "POST", C, completion(prompt=[1] * (CONTEXT + 10)), AUTH, 400, INVALID, "prompt"),
    ("text-prompt-over-context", "POST", C, completion(prompt="hello " * 12_000), AUTH, 400, INVALID, "prompt"),
    ("prompt-plus-max-tokens", "POST", C, completion(prompt=[1] * 8000, max_tokens=500), AUTH, 400, INVALID, "max_tokens"),
    ("best-of-unsupported", "POST", C, completion(best_of=3), AUTH, 400, INVALID, "best_of"),
    ("suffix-unsupported", "POST", C, completion(suffix="end"), AUTH, 400, INVALID, "suffix"),
    ("max-tokens-zero-without-echo", "POST", C, completion(max_tokens=0), AUTH, 400, INVALID, "max_tokens"),
    ("stream-options-without-stream", "POST", C, completion(stream_options={"include_usage": True}), AUTH, 400, INVALID, "stream_options"),
    ("stream-wrong-type", "POST", C, completion(stream="yes"), AUTH, 400, INVALID, "stream"),
    ("chat-missing-messages", "POST", CH, {"model": MODEL}, AUTH, 400, INVALID, "messages"),
    ("chat-empty-messages", "POST", CH, chat(messages=[]), AUTH, 400, INVALID, "messages"),
    ("chat-messages-not-list", "POST", CH, chat(messages="hi"), AUTH, 400, INVALID, "messages"),
    ("chat-bad-role", "POST", CH, chat(messages=[{"role": "function", "content": "x"}]), AUTH, 400, INVALID, "messages[0].role"),
    ("chat-tool-without-call-id", "POST", CH, chat(messages=[{"role": "tool", "content": "x"}]), AUTH, 400, INVALID, "messages[0].tool_call_id"),
    ("chat-image-part", "POST", CH, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), AUTH, 400, INVALID, "messages[0].content[0].type"),
    ("chat-content-missing", "POST", CH, chat(messages=[{"role": "user"}]), AUTH, 400, INVALID, "messages[0].content"),
    ("chat-content-wrong-type", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), AUTH, 400, INVALID, "messages[0].content"),
    ("chat-tool-name", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f()"}}]), AUTH, 400, INVALID, "tools[0].function.name"),
    ("chat-tool-choice-unknown", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                  tool_choice={"type": "function", "function": {"name": "g"}}), AUTH, 400, INVALID, "tool_choice"),
    ("chat-legacy-functions", "POST", CH, chat(functions=[{"name": "f"}]), AUTH, 400, INVALID, "functions"),
    ("completion-tools", "POST", C, completion(tools=[{"type": "function", "function": {"name": "f"}}]), AUTH, 400, INVALID, "tools"),
    ("chat-json-schema-without-schema", "POST", CH, chat(response_format={"type": "json_schema", "json_schema": {}}), AUTH, 400, INVALID, "response_format.json_schema.schema"),
    ("chat-response-format-type", "POST", CH, chat(response_format={"type": "grammar"}), AUTH, 400, INVALID, "response_format.type"),
    ("chat-top-logprobs-alone", "POST", CH, chat(top_logprobs=2), AUTH, 400, INVALID, "top_logprobs"),
    ("chat-top-logprobs-range", "POST", CH, chat(logprobs=True, top_logprobs=30), AUTH, 400, INVALID, "top_logprobs"),
    ("chat-max-completion-zero", "POST", CH, chat(max_completion_tokens=0), AUTH, 400, INVALID, "max_completion_tokens"),
    ("chat-max-completion-context", "POST", CH, chat(max_completion_tokens=100_000), AUTH, 400, INVALID, "max_completion_tokens"),
    ("unknown-model", "POST", C, completion(model="gpt-4"), AUTH, 404, INVALID, "model"),
    ("unknown-model-chat", "POST", CH, chat(model="gpt-4"), AUTH, 404, INVALID, "model"),
    ("unknown-model-get", "GET", "/v1/models/gpt-4", None, AUTH, 404, INVALID, "model"),
    ("unknown-route", "POST", "/v1/embeddings", completion(), AUTH, 404, INVALID, None),
    ("unknown-route-root", "GET", "/nope", None, {}, 404, INVALID, None),
    ("wrong-method", "GET", C, None, AUTH, 405, INVALID, None),
    ("missing-key", "POST", C, completion(), {}, 401, INVALID, None),
    ("wrong-key", "POST", C, completion(), {"Authorization": "Bearer sk-wrong"}, 401, INVALID, None),
    ("wrong-scheme", "POST", C, completion(), {"Authorization": f"Basic {API_KEY}"}, 401, INVALID, None),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_request(server: ServerProcess, case: tuple[str, str, str, Any, dict[str, str], int, str, str | None]) -> None:
    _, method, path, body, headers, status, error_type, param = case
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = httpx.request(method, server.base_url + path, content=content,
                             headers={"Content-Type": "application/json", **headers}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]


def test_context_errors_have_the_openai_code(server: ServerProcess) -> None:
    for body in (completion(prompt=[1] * (CONTEXT + 10)), completion(prompt=[1] * 8000, max_tokens=500)):
        response = httpx.post(server.v1 + "/completions", json=body, headers=AUTH, timeout=60)
        assert response.json()["error"]["code"] == "context_length_exceeded"
    response = httpx.post(server.v1 + "/completions", json=completion(model="gpt-4"), headers=AUTH)
    assert response.json()["error"]["code"] == "model_not_found"


def test_harmless_unknown_fields_are_ignored(server: ServerProcess) -> None:
    body = chat(metadata={"a": "b"}, store=False, service_tier="auto", some_future_field=[1, 2],
                tool_choice="none", response_format={"type": "text"})
    response = httpx.post(server.v1 + "/chat/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_server_healthy_and_blocks_free_after_bad_requests(server: ServerProcess) -> None:
    for case in CASES:  # once more, back to back, then check that nothing was left behind
        _, method, path, body, headers, *_ = case
        content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        httpx.request(method, server.base_url + path, content=content, headers=headers, timeout=60)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert wait_until(lambda: engine_idle(server), timeout=60)
    response = httpx.post(server.v1 + "/completions", json=completion(max_tokens=3), headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


def test_oversized_body_is_refused_before_parsing(server: ServerProcess) -> None:
    body = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    response = httpx.post(server.v1 + "/completions", content=body, headers=AUTH, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == INVALID


def test_a_body_of_countless_tiny_arrays_is_refused_before_parsing(server: ServerProcess) -> None:
    # Parsing holds the event loop ~0.6 µs per array: 32 MB of `[1],` would stall everyone ~4 s.
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": [' + b"[1]," * 100_000 + b"[1]]}"
    response = httpx.post(server.v1 + "/completions", content=body, headers=AUTH, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["type"] == INVALID
    text = "[{" * 40_000  # brackets inside strings are text, not structure
    response = httpx.post(server.v1 + "/completions", json=completion(prompt=[1, 2], stop=[text[:10]], user=text),
                          headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
