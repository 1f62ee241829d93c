"""POST /v1/responses served over the chat path: the request (`responses.py`) becomes a chat
completion, and its answer the Responses API's output items, whole or as OpenAI's stream
events (the order is in `responses.py`'s docstring)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

from backfill.engine.async_engine import EngineError, RequestStream
from backfill.entrypoints.openai.responses import (
    ITEMS, PARAM_RENAMES, DeletedResponse, InputItemList, OutputFunctionCall, OutputMessage, OutputText,
    ResponseObject, ResponsesRequest, ResponseUsage, as_input, listed_item)
from backfill.entrypoints.openai.responses_store import ResponseStore
from backfill.entrypoints.openai.serving import OpenAIServing, SSEStream, engine_error
from backfill.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from backfill.entrypoints.openai.wire import APIError, bad_request


class OutputItems:
    """The output items of one answer, built from the chat path's deltas (`{"content": text}`,
    or `{"tool_calls": [...]}` as `ToolCallStream` sends them), and the stream events that add
    them: each `feed` returns the events for its delta; `close` ends the last item."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.items: list[OutputMessage | OutputFunctionCall] = []
        self._event = event
        self._open = False  # the last item has had no output_item.done yet

    def feed(self, delta: dict[str, Any]) -> list[str]:
        if "content" in delta:
            return self._text(delta["content"])
        events = []
        for call in delta["tool_calls"]:
            function = call.get("function", {})
            if "id" in call:  # a new call: its header
                events += self._close("completed")
                item = OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call["id"], name=function["name"],
                                          arguments="", status="in_progress")
                events += self._add(item)
            if function.get("arguments"):
                item = self.items[-1]
                assert isinstance(item, OutputFunctionCall)
                item.arguments += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=len(self.items) - 1, delta=function["arguments"]))
        return events

    def close(self, status: Literal["completed", "incomplete"]) -> list[str]:
        """End the output: the last item gets `status`; an answer with no output is one empty message."""
        return (self._text("") if not self.items else []) + self._close(status)

    def _text(self, text: str) -> list[str]:
        events = []
        if not self._open or not isinstance(self.items[-1], OutputMessage):
            events += self._close("completed")
            events += self._add(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[]))
            self.items[-1].content.append(OutputText(text=""))  # type: ignore[union-attr]
            events.append(self._event("response.content_part.added", **self._where(),
                                      part=OutputText(text="").model_dump(mode="json")))
        part = self.items[-1].content[0]  # type: ignore[union-attr]
        if text:
            part.text += text
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _add(self, item: OutputMessage | OutputFunctionCall) -> list[str]:
        self.items.append(item)
        self._open = True
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=item.model_dump(mode="json"))]

    def _close(self, status: Literal["completed", "incomplete"]) -> list[str]:
        if not self._open:
            return []
        self._open = False
        item, index = self.items[-1], len(self.items) - 1
        item.status = status
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self._event("response.output_text.done", **self._where(), text=part.text, logprobs=[]),
                      self._event("response.content_part.done", **self._where(), part=part.model_dump(mode="json"))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  arguments=item.arguments)]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=item.model_dump(mode="json"))]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1, "content_index": 0}


# ---- serving -------------------------------------------------------------------------------


# The chat path's field names where an error's text mentions them (not its param).
_NAMES_IN_TEXT = re.compile(r"\b(response_format|max_tokens)\b")


def rename_error(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses request's fields instead."""
    message, param = error.message, error.param
    key = param if param in PARAM_RENAMES else re.split(r"[.\[]", param or "")[0]
    if param is not None and key in PARAM_RENAMES:
        param = PARAM_RENAMES[key] + param[len(key):]
        message = message.replace(error.param or "", param, 1)
    message = _NAMES_IN_TEXT.sub(lambda match: PARAM_RENAMES[match.group(1)], message)
    if (param, message) == (error.param, error.message):
        return error
    return APIError(error.status_code, message, error.type, param, error.code, error.headers)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:100]}' not found.", param=None, code="not_found")


def _no_event(kind: str, **fields: Any) -> str:
    return ""


class ResponsesServing:
    """POST /v1/responses over OpenAIServing's chat path. Runs on the event loop only."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store if store is not None else ResponseStore(0)

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | SSEStream:
        response_id = f"resp_{uuid.uuid4().hex}"
        history = self._history(request.previous_response_id)
        store = request.store is not False and self.store.max_entries > 0
        try:
            chat = request.to_chat(ITEMS.validate_python(history))
            tool_plan = plan_tools(chat)
            prompts, params, streams = await self.serving.start_chat(chat, response_id, tool_plan)
        except APIError as error:
            raise rename_error(error) from None
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True) \
            if request.text is not None and request.text.format is not None else {"type": "text"}
        tools = [{"type": "function", **tool.model_dump(exclude={"type"})} for tool in request.tools or []]
        base = ResponseObject(id=response_id, created_at=int(time.time()), status="in_progress",
                              instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                              max_tool_calls=request.max_tool_calls, model=self.serving.served_model_name,
                              temperature=params.temperature, top_p=params.top_p, text={"format": text_format},
                              tools=tools, tool_choice=request.echo_tool_choice(),
                              parallel_tool_calls=request.parallel_tool_calls is not False,
                              metadata=request.metadata or {}, store=store,
                              previous_response_id=request.previous_response_id)

        def finish(items: OutputItems, incomplete: bool, num_tokens: int) -> ResponseObject:
            usage = ResponseUsage.of(self.serving.usage(prompts, num_tokens, streams))
            final = base.model_copy(update={
                "status": "incomplete" if incomplete else "completed", "output": items.items, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None})
            if store:
                own = request.items()
                conversation = [*history, *(item.model_dump(exclude_none=True) for item in own),
                                *(as_input(item) for item in final.output)]
                self.store.put(final.model_dump(mode="json"), [listed_item(item) for item in own], conversation)
            return final

        if request.stream:
            return SSEStream(self._stream(base, streams, tool_plan, finish), streams)
        finals, _ = await self.serving.collect(streams)
        completion = finals[(0, 0)]
        items = OutputItems(_no_event)
        finish_reason = completion.finish_reason
        if tool_plan is None:
            items.feed({"content": completion.text})
        else:
            content, calls, finish_reason = tool_plan.answer(completion.text, finish_reason or "stop")
            for delta in [{"content": content}] if content else []:
                items.feed(delta)
            for call in calls:
                items.feed({"tool_calls": [{"id": call.id, "function": call.function.model_dump()}]})
        incomplete = finish_reason == "length"
        items.close("incomplete" if incomplete else "completed")
        return finish(items, incomplete, len(completion.token_ids))

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation of the stored response a request continues ([] when none)."""
        if previous_response_id is None:
            return []
        entry = self.store.get(previous_response_id)
        if entry is None:
            reason = "" if self.store.max_entries else \
                " (this server stores no responses: --max-stored-responses 0, or --replicas)"
            raise APIError(400, f"Previous response with id '{previous_response_id[:100]}' not found{reason}.",
                           param="previous_response_id", code="previous_response_not_found")
        return entry.conversation

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return ResponseObject.model_validate(entry.response)

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> InputItemList:
        """A stored response's own input items (not the earlier turns'), OpenAI's list page."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if not 1 <= limit <= 100:
            raise bad_request(f"limit: must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order: must be 'asc' or 'desc', got {order[:20]!r}", "order")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item {after[:100]!r} in this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)

    @staticmethod
    async def _stream(base: ResponseObject, streams: list[RequestStream], tool_plan: ToolPlan | None,
                      finish: Callable[[OutputItems, bool, int], ResponseObject]) -> AsyncGenerator[str, None]:
        sequence_number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence_number
            payload = {"type": kind, "sequence_number": sequence_number, **fields}
            sequence_number += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        def response(value: ResponseObject) -> dict[str, Any]:
            return value.model_dump(mode="json")

        items = OutputItems(event)
        tool_stream = tool_plan.stream() if tool_plan is not None else None
        finish_reason, num_tokens = None, 0
        try:
            yield event("response.created", response=response(base))
            yield event("response.in_progress", response=response(base))
            async for output in streams[0]:
                completion = output.outputs[0]
                num_tokens, finish_reason = len(completion.token_ids), completion.finish_reason
                if tool_stream is None:
                    deltas = [{"content": completion.delta_text}] if completion.delta_text else []
                else:
                    deltas = tool_stream.feed(completion.delta_text, finish_reason)
                    finish_reason = tool_stream.finish_reason
                for delta in deltas:
                    for line in items.feed(delta):
                        yield line
            incomplete = finish_reason == "length"
            for line in items.close("incomplete" if incomplete else "completed"):
                yield line
            final = finish(items, incomplete, num_tokens)
            yield event(f"response.{final.status}", response=response(final))
        except EngineError as error:
            body = engine_error(error).to_dict()["error"]
            yield event("error", code=body["code"], message=body["message"], param=body["param"])
        finally:
            for stream in streams:
                stream.close()
