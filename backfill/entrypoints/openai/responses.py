"""POST /v1/responses: OpenAI's Responses API, text in and text out, over the chat path.

A request becomes a chat completion (`instructions` a system message first, `input` the
conversation, `text.format` the output constraint), so it is rendered, checked and scheduled
exactly as one. Nothing is stored: `previous_response_id`, `conversation` and `background`
are refused, as are tools, reasoning and the other fields that would change the result.

Streaming sends OpenAI's events in OpenAI's order, each as `event: <type>` and `data: <json>`
with a rising `sequence_number`: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (one per
step that adds text), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete when
max_output_tokens cut the text). An engine failure mid-stream ends it with an `error` event.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from backfill.engine.async_engine import EngineError, RequestStream
from backfill.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatMessage, JSONSchemaFormat, ResponseFormat, UsageInfo, refused_fields)
from backfill.entrypoints.openai.wire import APIError, ResponseModel, StrictModel
from backfill.entrypoints.openai.serving import OpenAIServing, SSEStream, engine_error

# Responses API fields that would change the result and that this server does not honour.
UNSUPPORTED_RESPONSE_FIELDS = {
    "tools": "tools are not supported by this server",
    "previous_response_id": "this server stores no responses: send the whole conversation as input",
    "conversation": "this server stores no conversations: send the whole conversation as input",
    "background": "background responses are not supported by this server",
    "reasoning": "this model does not reason: reasoning is not supported",
    "include": "no extra output data can be included by this server",
    "prompt": "stored prompt templates are not supported by this server",
    "max_tool_calls": "tools are not supported by this server",
    "top_logprobs": "logprobs are not supported on /v1/responses by this server",
    "context_management": "context management is not supported by this server",
}
# Where the chat path's error params point in a Responses request.
_PARAM_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                  "response_format.json_schema.schema": "text.format.schema"}


# ---- requests ------------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as input
    text: str


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]


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
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = None
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto"] | None = None  # with no tools, both mean "answer in text"
    parallel_tool_calls: bool | None = None  # no tools: nothing to call in parallel
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: refused
    # Accepted, and changing nothing: store (nothing is stored), metadata, user, service_tier, ...
    metadata: dict[str, str] | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[InputMessage]) -> str | list[InputMessage]:
        if not value:
            raise ValueError("must not be empty")
        return value

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for."""
        messages = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            for item in self.input:
                content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
                messages.append(ChatMessage(role=item.role, content=content))
        response_format = None
        if self.text is not None and self.text.format is not None:
            fmt = self.text.format
            schema = None if fmt.type != "json_schema" else JSONSchemaFormat(name=fmt.name, schema=fmt.json_schema)
            response_format = ResponseFormat(type=fmt.type, json_schema=schema)
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     response_format=response_format)


# ---- responses -----------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


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


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


# ---- serving -------------------------------------------------------------------------------


def rename_error(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses request's field instead."""
    if error.param is None:
        return error
    key = error.param if error.param in _PARAM_RENAMES else re.split(r"[.\[]", error.param)[0]
    if key not in _PARAM_RENAMES:
        return error
    param = _PARAM_RENAMES[key] + error.param[len(key):]
    message = error.message.replace(error.param, param, 1)
    return APIError(error.status_code, message, error.type, param, error.code, error.headers)


class ResponsesServing:
    """POST /v1/responses over OpenAIServing's chat path. Runs on the event loop only."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | SSEStream:
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            prompts, params, streams = await self.serving.start_chat(request.to_chat(), response_id)
        except APIError as error:
            raise rename_error(error) from None
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True) \
            if request.text is not None and request.text.format is not None else {"type": "text"}
        base = ResponseObject(id=response_id, created_at=int(time.time()), status="in_progress",
                              instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                              model=self.serving.served_model_name, temperature=params.temperature,
                              top_p=params.top_p, text={"format": text_format}, metadata=request.metadata or {})
        message_id = f"msg_{uuid.uuid4().hex}"

        def finish(text: str, finish_reason: str | None, num_tokens: int) -> ResponseObject:
            incomplete = finish_reason == "length"
            status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
            message = OutputMessage(id=message_id, status=status, content=[OutputText(text=text)])
            usage = ResponseUsage.of(self.serving.usage(prompts, num_tokens, streams))
            return base.model_copy(update={
                "status": status, "output": [message], "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None})

        if request.stream:
            return SSEStream(self._stream(base, message_id, streams, finish), streams)
        finals, _ = await self.serving.collect(streams)
        completion = finals[(0, 0)]
        return finish(completion.text, completion.finish_reason, len(completion.token_ids))

    @staticmethod
    async def _stream(base: ResponseObject, message_id: str, streams: list[RequestStream],
                      finish: Callable[[str, str | None, int], ResponseObject]) -> AsyncGenerator[str, None]:
        sequence_number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence_number
            payload = {"type": kind, "sequence_number": sequence_number, **fields}
            sequence_number += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        def response(value: ResponseObject) -> dict[str, Any]:
            return value.model_dump(mode="json")

        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        deltas: list[str] = []
        finish_reason, num_tokens = None, 0
        try:
            yield event("response.created", response=response(base))
            yield event("response.in_progress", response=response(base))
            item = OutputMessage(id=message_id, status="in_progress", content=[])
            yield event("response.output_item.added", output_index=0, item=item.model_dump(mode="json"))
            yield event("response.content_part.added", **where, part=OutputText(text="").model_dump(mode="json"))
            async for output in streams[0]:
                completion = output.outputs[0]
                num_tokens, finish_reason = len(completion.token_ids), completion.finish_reason
                if completion.delta_text:
                    deltas.append(completion.delta_text)
                    yield event("response.output_text.delta", **where, delta=completion.delta_text, logprobs=[])
            text = "".join(deltas)
            final = finish(text, finish_reason, num_tokens)
            part = final.output[0].content[0].model_dump(mode="json")
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part=part)
            yield event("response.output_item.done", output_index=0, item=final.output[0].model_dump(mode="json"))
            yield event(f"response.{final.status}", response=response(final))
        except EngineError as error:
            body = engine_error(error).to_dict()["error"]
            yield event("error", code=body["code"], message=body["message"], param=body["param"])
        finally:
            for stream in streams:
                stream.close()
