"""Every field of both endpoints, fed odd values: each answer is a 200 or a 400 naming the field.

Never a 500, never a traceback in the server's log (the `server` fixture checks that at the end
of the session), and the server is healthy and idle afterwards.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ODD: list[Any] = [None, True, -1, 2**63, -(10**30), 1.5, 1e308, "x", "", "²", "--5", "\x00🚀", [], [None],
                  [1, "a"], ["a"] * 3, {}, {"--5": 1}, {"²": 1}]
# Raw JSON the encoder will not write but pydantic's parser reads.
ODD_RAW = [b"NaN", b"-Infinity", b"1e400"]
# A lone surrogate: JSON to Python's parser, not text to pydantic's. Wherever it is, the body
# does not parse: a 400 that cannot name a field.
MALFORMED_RAW = [b'"\\ud800"']

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
SAMPLING_FIELDS = ["temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "repetition_penalty",
                   "min_tokens", "ignore_eos", "stop_token_ids", "tools", "functions"]
FIELDS = {
    "/v1/completions": (COMPLETION, SAMPLING_FIELDS + ["prompt", "max_tokens", "logprobs", "echo", "best_of",
                                                       "suffix"]),
    "/v1/chat/completions": (CHAT, SAMPLING_FIELDS + ["messages", "max_tokens", "max_completion_tokens", "logprobs",
                                                      "top_logprobs", "response_format", "tool_choice", "modalities",
                                                      "parallel_tool_calls", "function_call",
                                                      "messages[0].role", "messages[0].content",
                                                      "messages[0].content[0].text", "messages[0].name"]),
}


def body_with(base: dict[str, Any], field: str, raw_value: bytes) -> bytes:
    """`base` as JSON with `field` (a dotted path like messages[0].content[0].text) set to raw JSON."""
    marker = "\x00FUZZ\x00"
    body = json.loads(json.dumps(base))
    if field == "messages[0].content[0].text":
        body["messages"][0]["content"] = [{"type": "text", "text": marker}]
    elif field.startswith("messages[0]."):
        body["messages"][0][field.split(".")[1]] = marker
    else:
        body[field] = marker
    return json.dumps(body).encode().replace(json.dumps(marker).encode(), raw_value)


def cases() -> list[tuple[str, str, bytes]]:
    """(path, field, body) for every field and odd value."""
    out = []
    for path, (base, fields) in FIELDS.items():
        for field in fields:
            values = [json.dumps(value).encode() for value in ODD] + ODD_RAW + MALFORMED_RAW
            if field in ("max_tokens", "max_completion_tokens"):
                # A 200 must stay short: no null (up to the context), the chat's other limit kept.
                values.remove(b"null")
                base = {**base, "max_completion_tokens": 1} if path.startswith("/v1/chat") and field == "max_tokens" else base
            out += [(path, field, body_with(base, field, value)) for value in values]
    return out


def is_malformed(body: bytes) -> bool:
    return any(raw in body for raw in MALFORMED_RAW)


def send(server: ServerProcess, case: tuple[str, str, bytes]) -> tuple[str, str, bytes, int, dict[str, Any]]:
    path, field, body = case
    response = httpx.post(server.base_url + path, content=body, headers=AUTH, timeout=120)
    try:
        payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    except ValueError:
        payload = {}
    return path, field, body, response.status_code, payload


def test_every_field_with_odd_values_is_a_200_or_a_400_naming_it(server: ServerProcess) -> None:
    all_cases = cases()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda case: send(server, case), all_cases))
    failures = []
    for path, field, body, status, payload in results:
        error = payload.get("error", {})
        if is_malformed(body):
            if status != 400 or error.get("param") is not None or "parse the JSON" not in error.get("message", ""):
                failures.append((path, field, body[:200], status, error))
            continue
        if status == 200:
            continue
        top = field.split(".")[0].split("[")[0]
        named = (error.get("param") or "").split(".")[0].split("[")[0]
        # Fields that depend on each other may be reported under their partner.
        partners = {"stream_options": {"stream_options", "stream"}, "top_logprobs": {"top_logprobs", "logprobs"},
                    "echo": {"echo"}, "min_tokens": {"min_tokens", "max_tokens"}}
        if status != 400 or error.get("type") != "invalid_request_error" or named not in partners.get(top, {top}):
            failures.append((path, field, body[:200], status, error))
    assert not failures, "\n".join(map(repr, failures))
    assert len(results) > 1000 and sum(status == 200 for *_, status, _ in results) > 100  # some values are fine
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert wait_until(lambda: engine_idle(server), timeout=60)


@pytest.mark.parametrize("path", list(FIELDS))
def test_odd_bodies_are_400s(server: ServerProcess, path: str) -> None:
    for body in [b"null", b"1", b'"x"', b"[]", b"{", b"\xff\xfe", b'{"model": ' + b"[" * 5000 + b"]" * 5000 + b"}"]:
        response = httpx.post(server.base_url + path, content=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, (body[:40], response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
