"""POST /tokenize and /detokenize (vLLM's utility endpoints): the server's own tokenizer and
chat template, for clients that count or inspect tokens before they send a request.

A /tokenize body holds `prompt` (tokenized as /v1/completions would) or `messages` (rendered as
/v1/chat/completions would, with the same chat template controls and the `tools` and `tool_choice`
it offers the model), never both.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from backfill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from backfill.entrypoints.openai.wire import ResponseModel, StrictModel, bad_request, validation_error_to_api_error
from backfill.entrypoints.openai.serving import LONG_TEXT_CHARS
from backfill.entrypoints.openai.tool_calls import plan_tools

if TYPE_CHECKING:
    from backfill.entrypoints.openai.serving import OpenAIServing


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # prompt: true by default; messages: the template writes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # messages: rendered with them, as the chat request would be
    tool_choice: Any = None
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizationServing:
    """The two endpoints over the generation endpoints' tokenizer and chat rendering."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        serving.check_model(request.model)
        if request.prompt is not None and request.messages is not None:
            raise bad_request("messages: give a prompt or messages, not both", "messages")
        if request.prompt is None and request.messages is None:
            raise bad_request("prompt: give a prompt (text) or messages (a conversation)", "prompt")
        if request.messages is not None:
            if request.add_special_tokens:
                raise bad_request("add_special_tokens: the chat template writes the special tokens of a "
                                  "conversation; leave it out with messages", "add_special_tokens")
            fields = {name: getattr(request, name) for name in ("messages", "add_generation_prompt",
                      "continue_final_message", "chat_template_kwargs", "tools", "tool_choice")}
            try:
                chat = ChatCompletionRequest.model_validate(fields)
            except ValidationError as error:
                raise validation_error_to_api_error(error.errors()) from None
            chat.check_messages()
            _, ids = await serving.render_chat(chat, plan_tools(chat))
        else:
            assert request.prompt is not None
            serving.check_prompt_chars(len(request.prompt), "prompt")
            for name in ("tools", "tool_choice"):
                if getattr(request, name) is not None:
                    raise bad_request(f"{name}: only with messages", name)
            add_special = request.add_special_tokens is not False
            if len(request.prompt) > LONG_TEXT_CHARS:
                ids = await asyncio.to_thread(serving.tokenizer.encode, request.prompt, add_special)
            else:
                ids = serving.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        serving = self.serving
        serving.check_model(request.model)
        vocab_size = min(serving.vocab_size, serving.tokenizer.vocab_size)
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens: {bad} is not a token id in [0, {vocab_size})", "tokens")
        if len(request.tokens) > LONG_TEXT_CHARS:
            text = await asyncio.to_thread(serving.tokenizer.decode, request.tokens, False)
        else:
            text = serving.tokenizer.decode(request.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
