"""The OpenAI wire format: pydantic request and response models (the error object and the
strict JSON parsing they rest on: `wire.py`).

Requests are parsed strictly from JSON (`"max_tokens": "10"` or `true` is a 400, as at OpenAI).
Unknown fields are ignored, as OpenAI ignores fields it does not know, except fields that would
change the result and that we do not support: those are declared here and rejected with a 400
naming them (`tools` on /v1/completions, the legacy `functions`/`function_call` (use `tools`),
`suffix`, `best_of` other than `n`, `echo` together with `logprobs`, non-text message parts,
`function` messages, `modalities` other than text, and the fields of UNSUPPORTED_FIELDS and
UNSUPPORTED_CHAT_FIELDS). A client that relies on them learns it at once instead of getting a
silently different answer. Output constraints (`response_format`, vLLM's `guided_*` and
`structured_outputs`) become one `StructuredOutputsParams` (`SamplingFields.output_constraint`).
Tool calling on /v1/chat/completions is `tools`, `tool_choice` and `parallel_tool_calls`
(`tool_calls.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, create_model, field_validator

from backfill.entrypoints.openai.wire import APIError, ResponseModel, StrictModel, bad_request
from backfill.sampling_params import MAX_LOGPROBS, StructuredOutputsParams

# `priority` (vLLM's extension) range: aging lifts a waiting request one level per
# --priority-aging-steps, so the widest gap bounds how long a request can be overtaken.
MAX_PRIORITY = 1000
# Fields (vLLM's and OpenAI's) that would change the result and that this server does not
# honour: a 400 naming the field when set to anything but "off" (null, false, empty).
UNSUPPORTED_FIELDS = {
    "logits_processors": "custom logits processors are not supported by this server",
    "use_beam_search": "beam search is not supported by this server",
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported (JSON output is compact)",
    "structural_tag": "structural tags are not supported by this server",
    "functions": "legacy function calling is not supported; use tools and tool_choice",
}
UNSUPPORTED_CHAT_FIELDS = {
    "echo": "echo is not supported on chat completions",
    "chat_template": "a request's own chat template is not supported; the model's template is used",
    "documents": "documents (RAG) are not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "audio": "audio output is not supported by this server",
    "reasoning_effort": "this model does not reason: reasoning_effort is not supported",
    "verbosity": "verbosity is not supported by this server",
    "web_search_options": "web search is not supported by this server",
}
# vLLM's `guided_decoding_backend` values this server honours (it decodes with llguidance).
GUIDED_DECODING_BACKENDS = ("auto", "guidance", "llguidance")


def is_set(value: Any) -> bool:
    """Whether a field that can only be refused was given a value that asks for something.

    NOTE: `{}` asks (OpenAI's `web_search_options: {}` turns web search on); `[]` does not.
    """
    return value is not None and value is not False and not (isinstance(value, (str, list)) and not value)


def refused_fields(name: str, reasons: dict[str, str]) -> type[StrictModel]:
    """A base model that declares each field of `reasons` (`Any`, default None) and answers it,
    when set, with a 400 naming it and giving its reason: each field is listed once, in its
    table. `name` names the model (and its validator: bases of one model need distinct ones)."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        if is_set(value):
            raise ValueError(reasons[info.field_name or ""])
        return value

    fields: dict[str, Any] = {field: (Any, None) for field in reasons}
    validators = {f"_refuse_{name}": field_validator(*reasons)(refuse)}
    return create_model(name, __base__=StrictModel, __validators__=validators, **fields)  # type: ignore[no-any-return]


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class JSONSchemaFormat(StrictModel):
    """`response_format.json_schema`; `name`, `description` and `strict` do not change decoding
    (the output always matches the schema)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self, param: str) -> tuple[str, dict[str, Any]] | None:
        """(the param errors name, StructuredOutputsParams fields), None for plain text."""
        if self.type == "json_object":
            return param, {"json_object": True}
        if self.type == "text":
            return None
        if self.json_schema is None:
            raise bad_request(f"{param}.json_schema: required when type is json_schema", f"{param}.json_schema")
        if self.json_schema.json_schema is None:
            raise bad_request(f"{param}.json_schema.schema: required", f"{param}.json_schema.schema")
        return f"{param}.json_schema.schema", {"json": self.json_schema.json_schema}


class StructuredOutputsFields(refused_fields("UnsupportedStructuredOutputsFields", {
        "whitespace_pattern": UNSUPPORTED_FIELDS["guided_whitespace_pattern"],
        "structural_tag": UNSUPPORTED_FIELDS["structural_tag"]})):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> tuple[str, dict[str, Any]]:
        fields = self.model_dump(by_alias=True, include={"json_schema", "regex", "choice", "grammar", "json_object"},
                                 exclude_none=True)
        return "structured_outputs", fields


def constraint_error(error: ValueError, param: str) -> APIError:
    """A `ValueError("structured_outputs.<field>: ...")` as a 400 naming the field the user sent."""
    field, sep, rest = str(error).partition(": ")
    if param != "structured_outputs" and sep:
        field = param
    return bad_request(f"{field}: {rest}" if sep else str(error), field if sep else param)


class SamplingFields(refused_fields("UnsupportedFields", UNSUPPORTED_FIELDS)):
    """Fields shared by both endpoints. `None` means "the default", as OpenAI treats null."""

    model: str | None = None  # None: the served model
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Any = None  # str | list[str] | None, checked by _check_stop
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # The prompt's own tokens' logprobs with this many alternatives (response `prompt_logprobs`;
    # the request then computes its whole prompt: no prefix-cache hit).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (SamplingParams.bad_words)
    return_tokens_as_token_ids: bool | None = None  # logprobs show tokens as "token_id:<id>"
    # Keep only the prompt's last k tokens; -1: as many as the context leaves room for.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # lower runs first
    # backfill extension: seconds from arrival (queueing included) before the request ends with a
    # 408 `request_timeout` error; null: the server's --request-timeout
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Output constraints: at most one of these (response_format "text" constrains nothing).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_decoding_backend: str | None = None

    @field_validator("guided_decoding_backend")
    @classmethod
    def _check_backend(cls, value: str | None) -> str | None:
        if value is not None and value not in GUIDED_DECODING_BACKENDS:
            raise ValueError(f"this server decodes with llguidance: use one of {', '.join(GUIDED_DECODING_BACKENDS)} "
                             "or leave it out")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            strings = [] if value is None else [value]
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            strings = value
        else:
            raise ValueError("must be a string or a list of strings")
        if len(strings) > 16:
            raise ValueError("at most 16 stop sequences are supported")
        if "" in strings:
            raise ValueError("stop sequences must not be empty")
        return value

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def output_constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """What the output must match, and the request field that asked for it (errors name it).

        Raises APIError when more than one field asks for a constraint, or the one that asks is
        malformed. Whether the grammar engine accepts it is checked later, off the event loop.
        """
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and (found := self.response_format.constraint("response_format")):
            asked.append(found)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {kind: getattr(self, name)}))
        if self.structured_outputs is not None:
            asked.append(self.structured_outputs.constraint())
        if not asked:
            return None
        if len(asked) > 1:
            (first, _), (second, _) = asked[:2]
            raise bad_request(f"{second}: only one output constraint per request, and {first} is set too", second)
        param, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields), param
        except ValueError as error:
            raise constraint_error(error, param) from None


class CompletionRequest(SamplingFields, refused_fields("UnsupportedCompletionFields",
                                                      {"tools": "tools need /v1/chat/completions"})):
    """POST /v1/completions. `prompt`: a string, strings, token ids, or lists of token ids."""

    prompt: Any  # checked by _check_prompt; Any keeps union tags out of the error `param`
    max_tokens: int | None = Field(16, ge=0)  # null: up to the context length; 0: echo the prompt alone
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        def is_token(item: Any) -> bool:
            return isinstance(item, int) and not isinstance(item, bool)

        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string, list of strings, or list of token ids")
        if all(isinstance(item, str) for item in value):
            if any(not item for item in value):
                raise ValueError("must not contain empty strings")
            return value
        if all(is_token(item) for item in value):
            return value
        if all(isinstance(item, list) and item and all(is_token(t) for t in item) for item in value):
            return value
        raise ValueError("must be a non-empty string, list of strings, or list of token ids")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    def check(self) -> None:
        self.check_stream_options()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n: this server does not rank completions", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens: must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to compute: asked for, or echoed prompt's with `logprobs` (as vLLM)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no parameters
    strict: bool | None = None  # accepted; arguments are constrained only when a call is forced

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError('must be a JSON schema of an object ("type": "object")')
        return value


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns only
    tool_call_id: str | None = None  # tool turns only: the call this result answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatTemplateFields(StrictModel):
    """A conversation and how to render it (vLLM's chat template controls)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the model continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template

    def check_messages(self) -> None:
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise bad_request(f"messages[{index}].content is required for role {message.role!r}",
                                  f"messages[{index}].content")
            if message.content == []:  # as OpenAI: an array of parts has at least one
                raise bad_request(f"messages[{index}].content: empty array; expected at least one content part",
                                  f"messages[{index}].content")
            if message.tool_calls and message.role != "assistant":
                raise bad_request(f"messages[{index}].tool_calls: only assistant messages carry tool calls",
                                  f"messages[{index}].tool_calls")
            if message.role == "tool" and not message.tool_call_id:
                raise bad_request(f"messages[{index}].tool_call_id is required for role 'tool'",
                                  f"messages[{index}].tool_call_id")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise bad_request("continue_final_message: cannot be true together with add_generation_prompt "
                                  "(set add_generation_prompt to false)", "continue_final_message")
            last = self.messages[-1]
            if last.role != "assistant" or not last.text():
                raise bad_request("continue_final_message: the last message must be an assistant message with "
                                  "text to continue", "continue_final_message")


class ChatCompletionRequest(SamplingFields, ChatTemplateFields,
                            refused_fields("UnsupportedChatFields", UNSUPPORTED_CHAT_FIELDS)):
    """POST /v1/chat/completions."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    modalities: list[Literal["text"]] | None = None
    # Tool calling (`tool_calls.py`); `tool_choice` None: "auto" with tools, "none" without.
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | NamedToolChoice, by _check_tool_choice
    parallel_tool_calls: bool | None = None
    function_call: Any = None  # legacy: refused in check() unless "none" or "auto"

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> str | NamedToolChoice | None:
        if value is None or value in ("none", "auto", "required"):
            return value  # type: ignore[no-any-return]
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError:
                pass
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    def check(self) -> None:
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.function_call not in (None, "none", "auto"):  # without `functions`, those two change nothing
            raise bad_request("function_call: legacy function calling is not supported; use tools and tool_choice",
                              "function_call")
        self.check_messages()

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> its logprob, rank
# (1: the most likely) and text; the prompt's own token and the top-N alternatives.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


# vLLM's `stop_reason` of a choice: the stop string or stop token id that ended it (null for EOS,
# a length cut or anything else, and in every chunk of a stream but the one with finish_reason).
StopReason = int | str | None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # {"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}: only the keys a chunk sets,
    # as OpenAI sends them (clients concatenate the strings of one index).
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "backfill"
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
