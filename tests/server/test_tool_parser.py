"""Tool calling without a server: request checks, the forced-call constraint, parsing output
into calls (whole and streamed), and the prompt for a template without tools."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backfill.entrypoints.openai.protocol import ChatCompletionRequest
from backfill.entrypoints.openai.wire import APIError, parse_request
from backfill.entrypoints.openai.tool_calls import ToolPlan, closed_objects, parse_auto, plan_tools, prompt_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "properties": {}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": USER, **fields}
    parsed: ChatCompletionRequest = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    parsed.check()
    return parsed


def plan(**fields: Any) -> ToolPlan:
    result = plan_tools(request(**fields))
    assert result is not None
    return result


def stream_text(plan: ToolPlan, pieces: list[str], finish_reason: str = "stop") -> tuple[str, list[dict], str]:
    """Feed `pieces` through a ToolCallStream; (content, calls assembled as a client does, finish)."""
    stream = plan.stream()
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, finish_reason if i == len(pieces) - 1 else None)
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
            assert "id" in entry or "id" in call  # the first delta of a call carries its id
            entry.setdefault("id", call.get("id"))
    assert stream.finish_reason is not None
    return content, [calls[i] for i in sorted(calls)], stream.finish_reason


def test_plan_follows_tool_choice() -> None:
    assert plan_tools(request()) is None
    assert plan_tools(request(tools=[WEATHER], tool_choice="none")) is None
    assert plan(tools=[WEATHER]).mode == "auto"
    required = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert (required.mode, required.parallel) == ("required", False)
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name) == ("named", "get_time")
    assert named.schemas["get_time"] == {"type": "object", "properties": {}}  # filled in


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_plan_refuses_bad_tools(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as error:
        plan_tools(request(**fields))
    assert error.value.status_code == 400 and error.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_protocol_refuses_malformed_tool_fields(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as error:
        request(**body)
    assert error.value.status_code == 400 and error.value.param == param


def test_forced_constraints() -> None:
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs().json == closed_objects(SCHEMAS["get_weather"])  # type: ignore[union-attr]
    required = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = required.structured_outputs().json  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    items = schema["items"]["anyOf"]
    assert [item["properties"]["name"] for item in items] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert items[0]["properties"]["parameters"] == closed_objects(SCHEMAS["get_weather"])
    assert "maxItems" not in plan(tools=[WEATHER], tool_choice="required").structured_outputs().json  # type: ignore
    assert plan(tools=[WEATHER]).structured_outputs() is None


def test_a_forced_call_holds_only_the_declared_parameters() -> None:
    """Objects that list properties and say nothing of other keys are closed, nested ones and
    `$defs` too; objects that say something, the branches of an `allOf` of several (and the
    `$defs` they name) and values (`enum`, `default`) are not."""
    address = {"type": "object", "properties": {"street": {"type": "string"}}}
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "default": {"properties": {"x": {}}}},
        "address": address,
        "places": {"type": "array", "items": address},
        "either": {"anyOf": [address, {"type": "null"}]},
        "both": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"zip": {"type": "string"}}}]},
        "one": {"allOf": [address]},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "patterned": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        "properties": {"type": "object", "properties": {"required": {"type": "string"}}},
        "item": {"$ref": "#/$defs/Item"},
    }, "$defs": {"Item": address, "Base": address}}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["address"]["additionalProperties"] is False
    assert props["places"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {
        "type": "null"}
    assert props["one"]["allOf"][0]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False  # a parameter named "properties"
    assert props["properties"]["properties"] == {"required": {"type": "string"}}
    assert closed["$defs"]["Item"]["additionalProperties"] is False  # pydantic's nested models
    assert props["both"] == schema["properties"]["both"] and closed["$defs"]["Base"] == address
    assert props["open"] == schema["properties"]["open"] and props["patterned"] == schema["properties"]["patterned"]
    assert props["city"] == schema["properties"]["city"]
    assert "additionalProperties" not in address  # the caller's schema is not changed
    assert closed_objects({"type": "object"}) == {"type": "object"}  # nothing declared: left open


def test_required_keeps_each_tools_references_its_own() -> None:
    """Under "required" the tools' schemas sit inside an array: one that refers to its own
    `$defs` (or to itself) is moved under the array's `$defs` and its references rebased."""
    tree = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                             "child": {"$ref": "#"}, "tag": {"const": {"$ref": "#/x"}}},
            "$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string"}}}}}
    tools = [WEATHER, {"type": "function", "function": {"name": "tree", "parameters": tree}}]
    schema = plan(tools=tools, tool_choice="required").structured_outputs().json  # type: ignore[union-attr]
    weather, moved = (item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    assert weather == closed_objects(SCHEMAS["get_weather"]) and moved == {"$ref": "#/$defs/tool_1"}
    placed = schema["$defs"]["tool_1"]
    assert placed["properties"]["items"]["items"] == {"$ref": "#/$defs/tool_1/$defs/Item"}
    assert placed["properties"]["child"] == {"$ref": "#/$defs/tool_1"}
    assert placed["properties"]["tag"] == {"const": {"$ref": "#/x"}}  # a value, not a reference
    assert placed["$defs"]["Item"]["additionalProperties"] is False
    assert "$defs" not in plan(tools=[WEATHER], tool_choice="required").structured_outputs().json  # type: ignore


def test_forced_outputs_parse_or_fall_back_to_content() -> None:
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls = named.parse('{"city": "Paris"}')
    assert content is None and len(calls) == 1
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert named.parse('{"city": "Pa') == ('{"city": "Pa', [])  # cut by max_tokens
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    content, calls = required.parse('[{"name": "get_time", "parameters": {}}, '
                                    '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert content is None and [c.function.name for c in calls] == ["get_time", "get_weather"]
    assert len({c.id for c in calls}) == 2
    assert required.parse('[{"name": "get_time", "param')[1] == []


@pytest.mark.parametrize("text, content, names", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, ["get_weather"]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me check.\n", ["get_weather", "get_time"]),
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, ["get_time"]),  # no end tag
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> trailing', None, ["get_time"]),
    (' {"name": "get_weather", "parameters": {"city": "Oslo"}}', None, ["get_weather"]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]', None, ["get_time"] * 2),
    ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', "same", []),  # undeclared
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', "same", []),  # not an object
    ('<tool_call>{"name": "get_time", "argu', "same", []),
    ('{"city": "Paris"}', "same", []),  # JSON, but not a call
    ('{"name": ["get_time"], "arguments": {}}', "same", []),
    ("[" * 100_000, "same", []),
    ("It is sunny in Paris.", "same", []),
    ("", "same", []),
])
def test_parse_auto(text: str, content: str | None, names: list[str]) -> None:
    parsed_content, calls = parse_auto(text, SCHEMAS)
    assert parsed_content == (text if content == "same" else content)
    assert [call.function.name for call in calls] == names
    assert all(isinstance(json.loads(call.function.arguments), dict) for call in calls)


def test_auto_keeps_one_call_without_parallel_tool_calls() -> None:
    auto = plan(tools=[TIME], parallel_tool_calls=False)
    assert len(auto.parse('[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]')[1]) == 1


@pytest.mark.parametrize("pieces, content, names", [
    (["It is ", "sunny", "."], "It is sunny.", []),
    (["<tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>'], "", ["get_time"]),
    (["Sure. <to", 'ol_call>{"name": "get_time", "arguments": {}}', "</tool_call>"], "Sure. ", ["get_time"]),
    (["  {", '"name": "get_time", "arguments": {}}'], "", ["get_time"]),
    (["{", '"a": 1}'], '{"a": 1}', []),
    (["a <b> and <tool"], "a <b> and <tool", []),
    (["<", "b>"], "<b>", []),
])
def test_auto_stream_matches_whole_parse(pieces: list[str], content: str, names: list[str]) -> None:
    auto = plan(tools=[WEATHER, TIME])
    streamed_content, calls, finish = stream_text(auto, pieces)
    assert streamed_content == content
    assert [call["name"] for call in calls] == names
    assert finish == ("tool_calls" if names else "stop")
    whole_content, whole_calls = auto.parse("".join(pieces))
    assert (whole_content or "") == content and [c.function.name for c in whole_calls] == names


def test_forced_streams() -> None:
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = stream_text(named, ['{"ci', 'ty": "Paris"}'])
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert stream_text(named, ['{"ci', 'ty"'], "length")[2] == "length"
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    content, calls, finish = stream_text(required, ['[{"name": "get_time", ', '"parameters": {}}]'])
    assert (content, [c["name"] for c in calls], finish) == ("", ["get_time"], "tool_calls")
    assert stream_text(required, ['[{"name": "get_t'], "length") == ('[{"name": "get_t', [], "length")


def test_prompt_without_tool_support_in_the_template() -> None:
    history = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"}])
    messages, tools = prompt_messages(history.messages, plan_tools(history), chat_template="{{ messages }}")
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Rome"}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
    # tool_choice "none": the history is rendered, the tools are not offered
    plain, _ = prompt_messages(history.messages, None, chat_template="{{ messages }}")
    assert plain[0] == {"role": "system", "content": "Be brief."}


def test_prompt_through_a_template_that_knows_tools() -> None:
    history = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages, tools = prompt_messages(history.messages, plan_tools(history), chat_template="{% if tools %}{% endif %}")
    assert tools == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_required_stream_sends_each_call_when_its_item_is_complete() -> None:
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    stream = required.stream()
    assert stream.feed('[{"name": "get_time", "parameters": {', None) == []
    first = stream.feed('}}, {"name": "get_weather", ', None)
    assert [d["tool_calls"][0]["function"]["name"] for d in first] == ["get_time"]
    assert first[0]["tool_calls"][0]["index"] == 0 and first[0]["tool_calls"][0]["id"].startswith("call_")
    rest = stream.feed('"parameters": {"city": "Rome"}}]', "stop")
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"]) for d in rest] == [(1, "get_weather")]
    assert stream.finish_reason == "tool_calls"
    # Cut by max_tokens after one complete item: that call was sent; the finish says "length".
    content, calls, finish = stream_text(required, ['[{"name": "get_time", "parameters": {}}, {"na'], "length")
    assert (content, [c["name"] for c in calls], finish) == ("", ["get_time"], "length")


# A Hermes/Qwen-style template that knows tools (trimmed from Qwen2.5's).
TOOL_TEMPLATE = (
    # NOTE: transformers renders with trim_blocks: a newline right after a block tag is dropped.
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}<|im_start|>assistant{{ '\\n' }}")  # (a last newline of a template is dropped too)


def test_a_template_that_knows_tools_renders_them_and_the_history() -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from backfill.tokenizer import Tokenizer

    raw = RawTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", unk_token="<unk>")
    hf.chat_template = TOOL_TEMPLATE
    history = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages, tools = prompt_messages(history.messages, plan_tools(history), hf.chat_template)
    text, ids = Tokenizer(hf).encode_chat(messages, tools=tools)
    assert text == (f"<|im_start|>system\n<tools>\n{json.dumps(WEATHER)}\n</tools><|im_end|>\n"
                    "<|im_start|>user\nParis?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(hf.convert_tokens_to_ids("<|im_start|>")) == 5
