"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

What each `tool_choice` does (`ToolPlan`):
- "none": the tools stay out of the prompt and the answer is text.
- a named function: decoding is constrained (`structured_outputs.json`) to that tool's
  `parameters` schema, so the whole output IS the call's arguments object.
- "required": decoding is constrained to a JSON array of `{"name": <a tool's name>,
  "parameters": <that tool's schema>}` (at least one item; exactly one when
  `parallel_tool_calls` is false), as vLLM does.
- "auto" (the default with tools): decoding is free; the output is parsed afterwards
  (`parse_auto`): Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, or
  a bare JSON object/array of `{"name", "arguments"|"parameters"}`, naming declared tools.
  Anything else is plain content.
A forced call whose output does not parse (max_tokens ran out) is answered whole as it is
streamed (`ToolPlan.answer`): the calls or argument fragments written so far (content where
there are none) with the engine's finish reason: never an error.

The prompt (`prompt_messages`): when the model's chat template mentions `tools`, the tools and
the tool history go through the template as transformers passes them (`tools=[...]`, assistant
`tool_calls` with `arguments` as objects, `role: "tool"` turns). Otherwise (SmolLM2's template
knows nothing of tools) we fall back, as vLLM and llama.cpp do for generic models, to the
Hermes format in plain text: a system block listing the tools and the `<tool_call>` format, past
calls written as `<tool_call>` JSON in the assistant's turn, and tool results as a user turn of
`<tool_response>` blocks. Either way the text is message text, encoded as text
(`Tokenizer.encode_chat`): a tool's name or result never becomes a control token.

`strict` is accepted; arguments are constrained only when a call is forced (in "auto" the model
may answer in text, so no grammar applies).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from backfill.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatMessage, FunctionCall, NamedToolChoice, ToolCall)
from backfill.entrypoints.openai.wire import bad_request
from backfill.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams

MAX_TOOLS = 128  # as OpenAI
# The tools' JSON text together: it is compiled as one grammar for "required".
MAX_TOOLS_CHARS = MAX_GRAMMAR_CHARS // 2
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_DECODER = json.JSONDecoder()

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the prompt, the decoding and the output's parsing."""

    tools: list[dict[str, Any]]  # OpenAI-format function tools, `parameters` filled in
    mode: Mode
    name: str | None = None  # the forced function ("named")
    parallel: bool = True  # parallel_tool_calls

    @functools.cached_property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's `parameters` by its name."""
        return {tool["function"]["name"]: tool["function"]["parameters"] for tool in self.tools}

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of a forced call (its arguments' objects closed: `closed_objects`);
        None in "auto"."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=closed_objects(self.schemas[self.name]))
        if self.mode == "required":
            # A tool whose schema refers to its own parts ("#/$defs/Item", "#") is placed under the
            # array's `$defs` and its references rebased there: they would point into the array.
            defs, items = {}, []
            for index, (name, schema) in enumerate(self.schemas.items()):
                parameters = closed_objects(schema)
                if has_local_refs(parameters):
                    defs[f"tool_{index}"] = rebased(parameters, f"/$defs/tool_{index}")
                    parameters = {"$ref": f"#/$defs/tool_{index}"}
                items.append({"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                              "required": ["name", "parameters"], "additionalProperties": False})
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if defs:
                array["$defs"] = defs
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of one choice's whole output; no calls when it is not one."""
        calls: list[ToolCall] | None = None
        if self.mode == "named":
            arguments = _json_value(text)
            if isinstance(arguments, dict):
                assert self.name is not None
                calls = [make_call(self.name, arguments)]
        elif self.mode == "required":
            items = _json_value(text)
            if isinstance(items, list) and items:
                calls = _calls(items, self.schemas, "parameters")
        else:
            content, calls = parse_auto(text, self.schemas)
            if calls:
                return content, calls if self.parallel else calls[:1]
        return (None, calls) if calls else (text, [])

    def answer(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall], str]:
        """One choice's whole output as (content, tool calls, finish reason). A forced call that
        does not parse (max_tokens ran out) is answered as its stream answers it: the calls (or
        argument fragments) the stream would have sent, and the engine's finish reason."""
        content, calls = self.parse(text)
        if calls:
            return content, calls, "tool_calls"
        if self.mode == "auto":
            return text, [], finish_reason
        stream = self.stream()
        deltas = stream.feed(text, finish_reason)
        parts: list[str] = []
        heads: list[dict[str, Any]] = []
        arguments: list[list[str]] = []
        for delta in deltas:
            if "content" in delta:
                parts.append(delta["content"])
            for call in delta.get("tool_calls", []):
                if call["index"] == len(heads):
                    heads.append(call)
                    arguments.append([])
                arguments[call["index"]].append(call["function"].get("arguments", ""))
        made = [ToolCall(id=head["id"], function=FunctionCall(name=head["function"]["name"], arguments="".join(args)))
                for head, args in zip(heads, arguments)]
        return ("".join(parts) if parts or not made else None), made, stream.finish_reason or finish_reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def plan_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ToolPlan, None when no tool may be called. Raises APIError (400) naming
    `tools` or `tool_choice`."""
    tools = request.tools or []
    choice = request.tool_choice
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise bad_request(f"tools: function names must be unique; repeated: {', '.join(duplicates)}", "tools")
    dicts = []
    for tool in tools:
        function = tool.function.model_dump(exclude_none=True)
        function["parameters"] = function.get("parameters") or EMPTY_PARAMETERS
        dicts.append({"type": "function", "function": function})
    if len(json.dumps(dicts)) > MAX_TOOLS_CHARS:
        raise bad_request(f"tools: longer than {MAX_TOOLS_CHARS} characters as JSON", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        return ToolPlan(dicts, "named", choice.function.name, parallel=False)
    if choice == "required" and not tools:
        raise bad_request('tool_choice: "required" needs tools', "tool_choice")
    if choice == "none" or not tools:
        return None
    parallel = request.parallel_tool_calls is not False
    return ToolPlan(dicts, "required" if choice == "required" else "auto", parallel=parallel)


# ---- forced-call schemas -----------------------------------------------------------------

_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_VALUES = ("const", "enum", "default", "examples")  # data, not schemas
_DEFS = ("$defs", "definitions")
# Where closing an object would change what the schema means (a negation, a condition).
_NOT_CLOSED = ("not", "if", "then", "else", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties` and says nothing of other keys, `$defs` included (pydantic puts nested models
    there), except the branches of an `allOf` of several (each names only some of the
    properties the whole allows) and the `$defs` such a branch refers to.

    A forced call's arguments then hold only the parameters the tool declares, as OpenAI's
    strict mode requires of a schema: an undeclared key is nothing a function can take, and a
    small model left free to add keys writes prose into one until max_tokens runs out. Every
    output is still valid against the original schema (only instances are excluded, never
    added)."""
    return _close(schema, _combined_refs(schema, False))


def _close(schema: Any, keep: set[str]) -> Any:
    if isinstance(schema, list):
        return [_close(item, keep) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _VALUES or key in _NOT_CLOSED or (key == "allOf" and isinstance(value, list) and len(value) > 1):
            closed[key] = value
        elif key in _DEFS and isinstance(value, dict):
            closed[key] = {name: sub if f"#/{key}/{name}" in keep else _close(sub, keep) for name, sub in value.items()}
        elif key == "properties" and isinstance(value, dict):  # names, not keywords: a parameter may be "enum"
            closed[key] = {name: _close(sub, keep) for name, sub in value.items()}
        else:
            closed[key] = _close(value, keep)
    if isinstance(schema.get("properties"), dict) and not any(key in schema for key in _OPEN_KEYWORDS):
        closed["additionalProperties"] = False
    return closed


def _combined_refs(schema: Any, branch: bool) -> set[str]:
    """The `$ref`s named by the branches of an `allOf` of several (`branch`: `schema` is one)."""
    if isinstance(schema, list):
        return set().union(*(_combined_refs(item, branch) for item in schema))
    if not isinstance(schema, dict):
        return set()
    found = {schema["$ref"]} if branch and isinstance(schema.get("$ref"), str) else set()
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            found |= _combined_refs(list(value.values()), False)
        elif key not in _VALUES:
            found |= _combined_refs(value, key == "allOf" and isinstance(value, list) and len(value) > 1)
    return found


def rebased(schema: Any, base: str) -> Any:
    """`schema` placed at JSON pointer `base` of another document: its local `$ref`s ("#...")
    rewritten to point there (a tool's `$defs` stay its own, whatever the other tools call theirs)."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = f"#{base}{value[1:]}"
        elif key in _VALUES:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebased(value, base)
    return out


def has_local_refs(schema: Any) -> bool:
    return '"$ref": "#' in json.dumps(schema)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments_text))


def _json_value(text: str) -> Any:
    """`text` as one JSON value (surrounding whitespace allowed), or None."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # NOTE: "[[[[..." deeper than the stack is model output too
        return None


def _calls(items: list[Any], schemas: dict[str, dict[str, Any]], *keys: str) -> list[ToolCall] | None:
    """`items` as calls: each an object naming a declared tool, with its arguments object under
    the first of `keys` present (a JSON string of an object counts); None if any is not one."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in schemas:
            return None
        key = next((key for key in keys if key in item), None)
        arguments = item.get(key) if key else None
        if isinstance(arguments, str):
            arguments = _json_value(arguments)
        if not isinstance(arguments, dict):
            return None
        calls.append(make_call(item["name"], arguments))
    return calls


def parse_auto(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """Free output as (content, calls): Hermes `<tool_call>` blocks (the last may lack its end
    tag; text after the calls is dropped, as vLLM's Hermes parser does), or the whole output as a
    bare JSON call or array of calls. Content is the text before the calls (None when blank);
    when nothing parses as calls of declared tools, the whole text is the content."""
    start = text.find(TOOL_CALL_START)
    if start >= 0:
        items: list[Any] = []
        for block in _HERMES_BLOCK.finditer(text, start):
            value = _json_value(block.group(1))
            items += value if isinstance(value, list) else [value]
        calls = _calls(items, schemas, "arguments", "parameters")
        if calls:
            return text[:start] if text[:start].strip() else None, calls
        return text, []
    value = _json_value(text) if text.lstrip()[:1] in ("{", "[") else None
    calls = _calls(value if isinstance(value, list) else [value], schemas, "arguments", "parameters") \
        if value else None
    return (None, calls) if calls else (text, [])


# ---- streaming --------------------------------------------------------------------------


class ToolCallStream:
    """One choice's text deltas as OpenAI stream deltas (`{"content"}` or `{"tool_calls"}`).

    "named": the call's header comes first, then the decoded text as argument fragments.
    "required": each call is sent whole as soon as its item of the array is complete.
    "auto": content is sent as it comes while it cannot be the start of a call; from a
    `<tool_call>` (or an output that starts with `{` or `[`) on, the text is held back and sent
    at the end, as calls if it parses as calls (`ToolPlan.parse`), as content otherwise.
    `finish_reason` is "tool_calls" when the whole output parsed as calls. NOTE: calls sent
    cannot be taken back: a forced output cut by max_tokens ends with the calls (or argument
    fragments) sent so far and "length", and the whole answer is the same (`ToolPlan.answer`).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.finish_reason: str | None = None
        self._state = "undecided"  # "auto": then "content" or "held"
        self._held = ""  # text not sent yet (the whole output in "named" and "required")
        self._scan = 0  # "required": where the next item of the array may start in `_held`
        self._num_calls = 0  # calls sent

    def feed(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The deltas to send for `text`; on the last output (a finish reason), the rest."""
        step = {"named": self._named, "required": self._required, "auto": self._auto}[self.plan.mode]
        deltas = step(text)
        if finish_reason is not None:
            content, calls = self.plan.parse(self._held)
            self.finish_reason = "tool_calls" if calls else finish_reason
            if self.plan.mode != "named":
                if not calls and not self._num_calls and content:
                    deltas.append({"content": content})
                deltas += [self._call_delta(call) for call in calls[self._num_calls:]]
        return deltas

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        delta = {"index": self._num_calls, "id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
        self._num_calls += 1
        return {"tool_calls": [delta]}

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        self._held += text
        if not self._num_calls:
            deltas.append(self._call_delta(ToolCall(id=new_call_id(),
                                                    function=FunctionCall(name=self.plan.name or "", arguments=""))))
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _required(self, text: str) -> list[dict[str, Any]]:
        self._held += text
        deltas: list[dict[str, Any]] = []
        while "}" in text:  # an item may have ended
            start = len(self._held) - len(self._held[self._scan:].lstrip(" \n\t[,"))
            try:
                item, end = _DECODER.raw_decode(self._held, start)
            except (ValueError, RecursionError):
                break
            calls = _calls([item], self.plan.schemas, "parameters")
            if not calls:
                break
            deltas.append(self._call_delta(calls[0]))
            self._scan = end
        return deltas

    def _auto(self, text: str) -> list[dict[str, Any]]:
        self._held += text
        if self._state == "held":
            return []
        if self._state == "undecided":
            head = self._held.lstrip()
            if head[:1] in ("{", "[") or head.startswith(TOOL_CALL_START):
                self._state = "held"
                return []
            if not head or TOOL_CALL_START.startswith(head):
                return []  # may still become a call
            self._state = "content"
        start = self._held.find(TOOL_CALL_START)
        if start >= 0:
            content, self._held = self._held[:start], self._held[start:]
            self._state = "held"
        else:  # keep back a tail that may be the start of "<tool_call>"
            keep = next((n for n in range(len(TOOL_CALL_START) - 1, 0, -1)
                         if self._held.endswith(TOOL_CALL_START[:n])), 0)
            cut = len(self._held) - keep
            content, self._held = self._held[:cut], self._held[cut:]
        return [{"content": content}] if content else []


# ---- the prompt -------------------------------------------------------------------------


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def prompt_messages(messages: list[ChatMessage], plan: ToolPlan | None,
                    chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, its `tools` variable) for a conversation that may hold
    tool calls and results, and a plan whose tools are offered (see the module docstring)."""
    native = template_knows_tools(chat_template)
    out: list[dict[str, Any]] = []
    previous_tool = False  # the last entry holds tool results (fallback format)
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if native:
            if message.tool_calls:
                entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
            if message.role == "tool":
                entry["tool_call_id"] = message.tool_call_id
        elif message.tool_calls:
            blocks = [f"{TOOL_CALL_START}\n{_hermes_call(call)}\n{TOOL_CALL_END}" for call in message.tool_calls]
            entry["content"] = "\n".join(([entry["content"]] if entry["content"] else []) + blocks)
        elif message.role == "tool":
            block = f"<tool_response>\n{entry['content']}\n</tool_response>"
            if previous_tool:  # the results of one turn's calls: one user turn
                out[-1]["content"] += "\n" + block
                continue
            entry = {"role": "user", "content": block}
        previous_tool = message.role == "tool" and not native
        out.append(entry)
    if plan is None:
        return out, None
    if native:
        return out, plan.tools
    block = tools_system_prompt(plan.tools)
    if out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes function-calling system block (NousResearch's Hermes 2 Pro prompt format)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You are a function calling AI model. You may call one or more functions to assist with the "
            "user query. Here are the available functions, within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "Otherwise, answer in plain text.")


def _arguments(call: ToolCall) -> Any:
    """A past call's arguments as an object when they are JSON (as templates expect), else text."""
    value = _json_value(call.function.arguments)
    return value if isinstance(value, dict) else call.function.arguments


def _template_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": _arguments(call)}}


def _hermes_call(call: ToolCall) -> str:
    return json.dumps({"name": call.function.name, "arguments": _arguments(call)}, ensure_ascii=False)
