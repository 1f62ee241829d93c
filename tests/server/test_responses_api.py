"""POST /v1/responses with the official `openai` client: whole and streamed, instructions,
max_output_tokens, output constraints, and the fields it refuses."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

QUESTION = "What is the capital of France?"
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


def tokenize_chat(server: ServerProcess, messages: list[dict[str, str]]) -> int:
    response = httpx.post(server.base_url + "/tokenize", json={"messages": messages},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    return int(response.json()["count"])


def test_create_answers_with_a_response_object(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None
    assert "Paris" in response.output_text
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens == tokenize_chat(server, [{"role": "user", "content": QUESTION}])
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_become_the_system_message(client: openai.OpenAI, server: ServerProcess) -> None:
    instructions = "Answer in one word."
    response = client.responses.create(model=MODEL, input=QUESTION, instructions=instructions, max_output_tokens=5)
    assert response.instructions == instructions
    expected = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    assert response.usage is not None and response.usage.input_tokens == tokenize_chat(server, expected)


def test_input_as_message_items(client: openai.OpenAI, server: ServerProcess) -> None:
    items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "message", "role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": QUESTION}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=4)
    expected = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": QUESTION}]
    assert response.usage is not None and response.usage.input_tokens == tokenize_chat(server, expected)


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3 and response.output_text


@pytest.mark.parametrize("max_output_tokens, final", [(30, "response.completed"), (3, "response.incomplete")])
def test_stream_events_in_openai_order(client: openai.OpenAI, max_output_tokens: int, final: str) -> None:
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=max_output_tokens,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas and kinds == [*STREAM_ORDER[:4], *["response.output_text.delta"] * len(deltas),
                                *STREAM_ORDER[5:], final]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == "".join(deltas) == events[-4].text  # type: ignore[union-attr]
    assert done.status == final.removeprefix("response.")
    if final == "response.completed":
        whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0)
        assert whole.output_text == done.output_text


def test_raw_json_validates_against_the_sdk_models(server: ServerProcess) -> None:
    """The client builds its objects without validation; the SDK's models, validating, must
    accept every object and event as sent (each required field present, with its type)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    whole = httpx.post(server.v1 + "/responses", json=body, headers=headers, timeout=60).json()
    Response.model_validate(whole)
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=60,
                      headers=headers) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert len(lines) % 2 == 0
    for event_line, data_line in zip(lines[0::2], lines[1::2]):
        event = TypeAdapter(ResponseStreamEvent).validate_python(json.loads(data_line.removeprefix("data: ")))
        assert event_line == f"event: {event.type}"


def test_a_stream_the_client_leaves_is_aborted(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": "Write a very long story about a dragon.", "max_output_tokens": 4000,
            "stream": True}
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                break
    assert wait_until(lambda: engine_idle(server), timeout=60)


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon"]}},
              "required": ["capital"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                        "strict": True}})
    assert json.loads(response.output_text)["capital"] in ("Paris", "Lyon")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
     "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": ""}, "input"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
])
def test_bad_fields_are_refused(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**body)
    assert error.value.param == param, error.value.body
