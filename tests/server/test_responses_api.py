"""POST /v1/responses with the official `openai` client: whole and streamed, instructions,
max_output_tokens, output constraints, function tools, and the fields it refuses."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from backfill.entrypoints.openai.responses import ResponsesRequest
from backfill.entrypoints.openai.responses_serving import OutputItems
from backfill.entrypoints.openai.responses_store import ResponseStore
from backfill.entrypoints.openai.tool_calls import plan_tools
from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "strict": True, "parameters": {
               "type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 16}}}}
TIME = {"type": "function", "name": "get_time", "description": "Get the current time in a timezone", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["timezone"],
    "properties": {"timezone": {"type": "string", "maxLength": 16}}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = "What is the weather in Paris?"
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


def test_seed_makes_a_sampled_answer_repeatable(client: openai.OpenAI) -> None:
    story = "Invent the first line of a story about a dragon."  # open-ended: seeds differ
    texts = [client.responses.create(model=MODEL, input=story, max_output_tokens=16, temperature=1,
                                     extra_body={"seed": seed}).output_text for seed in (7, 7, 8, 9)]
    assert texts[0] == texts[1] and len(set(texts[1:])) > 1, texts
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, extra_body={"seed": "x"})
    assert error.value.param == "seed"


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
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "", "output": "1"}]}, "input[0].call_id"),
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
    message = error.value.body["message"]  # type: ignore[index]
    assert not re.search(r"\b(messages|max_tokens|response_format)\b", message), message  # the chat path's names


# ---- function tools ----------------------------------------------------------------------------


def calls_of(response: Response) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every function_call item; each is checked against its tool's schema."""
    calls = []
    for item in response.output:
        if item.type != "function_call":
            continue
        assert item.call_id.startswith("call_") and item.id and item.id.startswith("fc_")
        assert item.status == "completed"
        schema = next(tool["parameters"] for tool in TOOLS if tool["name"] == item.name)
        arguments = json.loads(item.arguments)
        assert set(schema["required"]) <= set(arguments) <= set(schema["properties"])
        assert all(isinstance(value, str) and len(value) <= 16 for value in arguments.values())
        calls.append((item.name, arguments))
    return calls


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "name": "get_time"}, {"get_time"}),
])
def test_a_forced_call_is_a_function_call_item(client: openai.OpenAI, tool_choice: Any, names: set[str]) -> None:
    response = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                       max_output_tokens=48, temperature=0)
    assert response.status == "completed" and response.output_text == ""
    calls = calls_of(response)
    assert calls and {name for name, _ in calls} <= names
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert response.tool_choice == tool_choice or response.tool_choice.model_dump() == tool_choice  # type: ignore


def test_no_parallel_tool_calls_gives_one_call(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=200, temperature=0.8)
    # (200 tokens: the one call's schema (16 characters a string) ends it sooner, whatever is sampled)
    assert len(calls_of(response)) == 1 and response.parallel_tool_calls is False


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_streamed_call_assembles_to_the_whole_answer(client: openai.OpenAI, tool_choice: Any) -> None:
    fields: dict[str, Any] = dict(model=MODEL, input=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                  max_output_tokens=48, temperature=0)
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:  # the SDK's helper checks the events' flow
        events = list(stream)
        streamed = stream.get_final_response()
    assert calls_of(streamed) == calls_of(whole) and calls_of(whole)
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert deltas == streamed.output[-1].arguments  # type: ignore[union-attr]


def test_a_forced_call_cut_by_max_output_tokens_is_the_same_whole_and_streamed(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, input=ASK_WEATHER, tools=TOOLS, max_output_tokens=3, temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**fields)
    streamed = list(client.responses.create(stream=True, **fields))[-1].response  # type: ignore[union-attr]
    for response in (whole, streamed):
        assert response.status == "incomplete" and response.output_text == ""
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.arguments.startswith("{")
    assert whole.output[0].arguments == streamed.output[0].arguments  # type: ignore[union-attr]


def test_auto_answers_the_same_whole_and_streamed(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, input=ASK_WEATHER, tools=TOOLS, max_output_tokens=48, temperature=0)
    whole = client.responses.create(**fields)
    events = list(client.responses.create(stream=True, **fields))
    streamed = events[-1].response  # type: ignore[union-attr]  (completed or incomplete)
    assert whole.tool_choice == "auto" and streamed.status == whole.status
    for response in (whole, streamed):
        assert response.output_text or calls_of(response)
    assert streamed.output_text == whole.output_text and calls_of(streamed) == calls_of(whole)


def test_a_call_and_its_output_sent_back_are_the_chat_conversation(client: openai.OpenAI) -> None:
    """The model's own output items, sent back with a function_call_output, render exactly as
    the chat completion with that assistant tool call and tool result."""
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=48, temperature=0)
    call = first.output[0]
    assert call.type == "function_call"
    items: Any = [{"role": "user", "content": ASK_WEATHER}, *first.output,
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    second = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    chat_tools: Any = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                       for tool in TOOLS]
    messages: Any = [
        {"role": "user", "content": ASK_WEATHER},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=1)
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_raw_tool_call_json_validates_against_the_sdk_models(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "input": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "parallel_tool_calls": False, "max_output_tokens": 200}  # one call, bounded by its schema
    whole = Response.model_validate(httpx.post(server.v1 + "/responses", json=body, headers=headers,
                                               timeout=60).json())
    assert whole.output and whole.output[0].type == "function_call"
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=60,
                      headers=headers) as response:
        lines = [line for line in response.iter_lines() if line]
    for data_line in lines[1::2]:
        TypeAdapter(ResponseStreamEvent).validate_python(json.loads(data_line.removeprefix("data: ")))


@pytest.mark.parametrize("chunks", [
    ["Let me check. <tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {\"timezone\": \"UTC\"}}\n</tool_call>"],
    ["<tool_call>{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"UTC\"}}</tool_call>"],
])
def test_text_then_a_call_streams_as_a_message_then_a_function_call(chunks: list[str]) -> None:
    """No model here: an "auto" answer of text and a Hermes call (whatever the model would say),
    through the chat path's ToolCallStream into output items, each event as the SDK validates it."""
    chat = ResponsesRequest.model_validate({"input": "x", "tools": TOOLS}).to_chat()
    plan = plan_tools(chat)
    assert plan is not None and plan.mode == "auto"
    events: list[Any] = []

    def event(kind: str, **fields: Any) -> str:
        events.append(TypeAdapter(ResponseStreamEvent).validate_python(
            {"type": kind, "sequence_number": len(events), **fields}))
        return kind

    items, stream = OutputItems(event), plan.stream()
    for index, chunk in enumerate(chunks):
        for delta in stream.feed(chunk, "stop" if index == len(chunks) - 1 else None):
            items.feed(delta)
    items.close("completed")
    assert stream.finish_reason == "tool_calls"
    text = chunks[0].split("<tool")[0]
    output = [item.model_dump(mode="json") for item in items.items]
    assert [item["type"] for item in output] == (["message"] if text else []) + ["function_call"]
    assert output[-1]["name"] == "get_time" and json.loads(output[-1]["arguments"]) == {"timezone": "UTC"}
    assert all(item["status"] == "completed" for item in output)
    if text:
        assert output[0]["content"][0]["text"] == text
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(output)
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]


def test_langchain_on_the_responses_api_calls_and_sends_back_a_tool(server: ServerProcess) -> None:
    """LangChain's ChatOpenAI with `use_responses_api`: a tool from a Python function (its schema
    says nothing of other keys, and the forced call still holds only `city`), whole and
    streamed, then the call and its ToolMessage sent back."""
    import langchain_openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "18 degrees and sunny"

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.v1, api_key=API_KEY, temperature=0,
                                       max_tokens=64, max_retries=0, timeout=120, use_responses_api=True)
    model = chat.bind_tools([get_weather], tool_choice="get_weather")
    whole = model.invoke(ASK_WEATHER)
    chunks = list(model.stream(ASK_WEATHER))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    for message in (whole, streamed):
        assert [call["name"] for call in message.tool_calls] == ["get_weather"]  # type: ignore[attr-defined]
        assert list(message.tool_calls[0]["args"]) == ["city"]  # type: ignore[attr-defined]
    assert streamed.tool_calls[0]["args"] == whole.tool_calls[0]["args"]  # type: ignore[attr-defined]
    call = whole.tool_calls[0]  # type: ignore[attr-defined]
    history = [HumanMessage(ASK_WEATHER), whole, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat.bind_tools([get_weather]).invoke(history)
    assert answer.response_metadata["status"] in ("completed", "incomplete") and answer.content


# ---- the store: previous_response_id, retrieve, input items, delete -----------------------------


def test_a_continued_response_is_the_whole_conversation(client: openai.OpenAI) -> None:
    """previous_response_id renders as the chat conversation of every turn (the earlier input and
    output, then the new input): same prompt tokens, same greedy answer."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0)
    assert first.store is True
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    messages: Any = [{"role": "user", "content": "My name is Ada."},  # instructions are not carried over
                     {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "What is my name?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # A third turn, streamed, continues the second (whose history holds the first).
    events = list(client.responses.create(model=MODEL, previous_response_id=second.id, input="Again?",
                                          max_output_tokens=4, temperature=0, stream=True))
    third = events[-1].response  # type: ignore[union-attr]
    assert third.previous_response_id == second.id
    assert client.responses.retrieve(third.id).output_text == third.output_text  # streamed ones are kept too
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_retrieve_list_input_items_and_delete(client: openai.OpenAI) -> None:
    items: Any = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
                  {"role": "user", "content": [{"type": "input_text", "text": "Three."}]}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0)
    kept = client.responses.retrieve(response.id)
    assert kept.model_dump() == response.model_dump()
    listed = list(client.responses.input_items.list(response.id, order="asc", limit=1))  # pages of one item
    assert [(item.type, item.role, item.content[0].text) for item in listed] == [  # type: ignore[union-attr]
        ("message", "user", "One."), ("message", "assistant", "Two."), ("message", "user", "Three.")]
    newest = client.responses.input_items.list(response.id).data  # default order: newest first
    assert [item.id for item in newest] == [item.id for item in listed][::-1]
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, previous_response_id=response.id, input="Four.", max_output_tokens=2)
    assert error.value.code == "previous_response_not_found" and error.value.param == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_store_drops_the_least_recently_used_first() -> None:
    store = ResponseStore(max_entries=3, max_bytes=10_000)

    def put(response_id: str, text: str = "x") -> None:
        store.put({"id": response_id}, [], [{"role": "user", "content": text}])

    for name in "abc":
        put(name)
    assert store.get("a") is not None  # a is now the most recently used
    put("d")
    assert [name for name in "abcd" if store.get(name) is not None] == ["a", "c", "d"]
    put("big", "y" * 9_940)  # ~9,990 bytes: with any other over the budget, so they go, oldest first
    assert store.get("big") is not None and len(store) == 1
    put("huge", "z" * 20_000)  # larger than the whole budget: not kept, nothing else dropped
    assert store.get("huge") is None and store.get("big") is not None
    assert ResponseStore(max_entries=0).max_entries == 0
