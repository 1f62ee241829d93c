"""POST /v1/responses: OpenAI's Responses API, text and function calls, over the chat path.

A request becomes a chat completion (`instructions` a system message first, `input` the
conversation, `text.format` the output constraint, `tools` / `tool_choice` /
`parallel_tool_calls` the chat path's function tools), so it is rendered, checked, scheduled
and its calls parsed exactly as one (`tool_calls.py`). Input items are messages,
`function_call` items (the model's earlier calls, sent back) and `function_call_output` items
(their results): consecutive calls become one assistant turn with `tool_calls`, each result a
`tool` turn. Output items are a `message` (the text, when there is any) then one
`function_call` item per call. A stored response (`responses_store.py`) keeps its whole
conversation as input items, so `previous_response_id` puts it before the request's input.
`conversation` and `background` are refused, as are built-in tools (web search, files, ...),
reasoning and the other fields that would change the result.

Streaming sends OpenAI's events in OpenAI's order, each as `event: <type>` and `data: <json>`
with a rising `sequence_number`: response.created, response.in_progress, then per output item
response.output_item.added, its content (a message: response.content_part.added,
response.output_text.delta per step that adds text, response.output_text.done,
response.content_part.done; a call: response.function_call_arguments.delta,
response.function_call_arguments.done) and response.output_item.done; then response.completed
(or response.incomplete when max_output_tokens cut the output). In "auto", text that may be a
call is held back until it is known not to be one, as on the chat path. An engine failure
mid-stream ends it with an `error` event.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator

from backfill.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatMessage, ChatTool, FunctionCall, FunctionDefinition, JSONSchemaFormat, ResponseFormat,
    ToolCall, UsageInfo, refused_fields)
from backfill.entrypoints.openai.wire import ResponseModel, StrictModel

# Responses API fields that would change the result and that this server does not honour.
UNSUPPORTED_RESPONSE_FIELDS = {
    "conversation": "conversations are not supported by this server: continue a response with "
                    "previous_response_id, or send the whole conversation as input",
    "background": "background responses are not supported by this server",
    "reasoning": "this model does not reason: reasoning is not supported",
    "include": "no extra output data can be included by this server",
    "prompt": "stored prompt templates are not supported by this server",
    "top_logprobs": "logprobs are not supported on /v1/responses by this server",
    "context_management": "context management is not supported by this server",
}
# Where the chat path's error params point in a Responses request.
PARAM_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                  "response_format.json_schema.schema": "text.format.schema"}
_TOOL_CHOICES = ("none", "auto", "required")


# ---- requests ------------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as input
    text: str


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made in an earlier response, sent back (`id` and `status` are ignored)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(StrictModel):
    """The result of the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _input_item_kind(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return {"message": "InputMessage", "function_call": "FunctionCallItem",
            "function_call_output": "FunctionCallOutputItem"}.get(kind)


# NOTE: the tags are the models' names, which `wire.loc_to_param` leaves out of an error's param.
InputItem = Annotated[
    Annotated[InputMessage, Tag("InputMessage")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
    Discriminator(_input_item_kind, custom_error_type="input_item_type", custom_error_message=(
        "must be a message, a function_call or a function_call_output item: this server has no other input items"))]


class FunctionTool(FunctionDefinition):
    """A function tool, flat as the Responses API declares it (`strict`: accepted, see tool_calls.py)."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else "function"
        if kind is None:
            raise ValueError('"type" is required: "function" (this server has only function tools)')
        if kind != "function":  # before the fields: a web_search tool has no `name` to complain of
            raise ValueError(f"only function tools are supported by this server, not {kind!r}")
        return value

    def to_chat(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; this server has no other


class ResponsesRequest(refused_fields("UnsupportedResponseFields", UNSUPPORTED_RESPONSE_FIELDS)):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # not OpenAI's; as on /v1/chat/completions (a field that changes the answer is honoured)
    stream: bool | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | FunctionChoice, by _check_tool_choice
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # bounds built-in tools' calls: there are none here
    # The store (responses_store.py): keep this response (OpenAI's default), or continue one kept.
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: refused
    # Accepted, and changing nothing: metadata, user, service_tier, ...
    metadata: dict[str, str] | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> str | FunctionChoice | None:
        if value is None or value in _TOOL_CHOICES:
            return value  # type: ignore[no-any-return]
        if isinstance(value, dict):
            try:
                return FunctionChoice.model_validate(value)
            except ValidationError:
                pass
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...}: '
                         "this server has only function tools")

    def items(self) -> list[InputItem]:
        """`input` as items (a string is one user message)."""
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def to_chat(self, history: list[InputItem] | None = None) -> ChatCompletionRequest:
        """The chat completion this request asks for; `history`: the items of the response it
        continues (its conversation), before this request's own. Instructions are this
        request's only, as OpenAI does not carry them over."""
        messages = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        for item in [*(history or []), *self.items()]:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
            else:  # the calls of one turn (and the text before them) are one assistant message
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        response_format = None
        if self.text is not None and self.text.format is not None:
            fmt = self.text.format
            schema = None if fmt.type != "json_schema" else JSONSchemaFormat(name=fmt.name, schema=fmt.json_schema)
            response_format = ResponseFormat(type=fmt.type, json_schema=schema)
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                     stream=self.stream,
                                     response_format=response_format, tool_choice=choice,
                                     tools=[tool.to_chat() for tool in self.tools] if self.tools else None,
                                     parallel_tool_calls=self.parallel_tool_calls)

    def echo_tool_choice(self) -> str | dict[str, Any]:
        """`tool_choice` as the response object reports it (OpenAI's default: "auto")."""
        if isinstance(self.tool_choice, FunctionChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"


# ---- responses -----------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the call's function_call_output names
    name: str
    arguments: str  # JSON text, as the model wrote it
    status: ItemStatus


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo) -> ResponseUsage:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return cls(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                   output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)


ITEMS = TypeAdapter(list[InputItem])


def as_input(item: OutputMessage | OutputFunctionCall) -> dict[str, Any]:
    """An output item as the input item that sends it back."""
    if isinstance(item, OutputMessage):
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": part.text} for part in item.content]}
    return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}


def listed_item(item: InputItem) -> dict[str, Any]:
    """An input item as GET /v1/responses/{id}/input_items lists it: with an id and a status."""
    if isinstance(item, InputMessage):
        kind = "output_text" if item.role == "assistant" else "input_text"
        content = [{"type": kind, "text": item.content}] if isinstance(item.content, str) \
            else [part.model_dump() for part in item.content]
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": item.role, "content": content,
                "status": "completed"}
    prefix = "fc" if isinstance(item, FunctionCallItem) else "fco"
    return {"id": f"{prefix}_{uuid.uuid4().hex}", **item.model_dump(), "status": "completed"}


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
