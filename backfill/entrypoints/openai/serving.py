"""OpenAIServing: translates OpenAI requests into engine requests and engine outputs into
OpenAI responses (whole, or as SSE chunks), with `usage` and `finish_reason` as OpenAI has them.

A batch of completion prompts becomes one engine request per prompt (`<id>-<i>`); choice `k` of
prompt `i` gets index `i * n + k`. Every exit path closes the engine streams, so a request
whose client is gone, or that failed half-way, is aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from backfill.core.outputs import TokenLogprobs
from backfill.engine.async_engine import (AsyncEngine, ConstraintFailedError, EngineDeadError, EngineError,
                                          EngineStoppedError, QueueFullError, RequestStream, RequestTimeoutError)
from backfill.entrypoints.openai.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatTemplateFields, ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, PromptLogprobs, PromptTokensDetails, SamplingFields, TokenLogprob, TopLogprob, UsageInfo,
    constraint_error)
from backfill.entrypoints.openai.wire import APIError, bad_request
from backfill.entrypoints.openai.token_text import TokenIds, TokenText
from backfill.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, plan_tools, prompt_messages
from backfill.outputs import CompletionOutput, RequestOutput
from backfill.sampling_params import SamplingParams, StructuredOutputsParams
from backfill.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    from backfill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
LONG_TEXT_CHARS = 20_000  # longer texts are tokenized in a worker thread, off the event loop
# Sequences (prompts x n) one request may create: what it may cost in memory and in steps is
# bounded before anything is tokenized, and the scheduler's fair share keeps it from
# starving other clients. vLLM has no such bound; OpenAI caps n at 128.
DEFAULT_MAX_SEQS_PER_REQUEST = 256
# NOTE: str.isdigit() accepts '²' and int() accepts '-5', ' 5' and '1_0': only this is an id.
_TOKEN_ID = re.compile(r"[0-9]{1,9}")


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class _CompletionForm:
    """What a completion's choices hold besides the new text."""

    echo: bool  # the prompt's text (and, with `logprobs`, its tokens' logprobs) first
    echo_only: bool  # max_tokens 0: the prompt alone (the token generated is dropped)
    logprobs: int | None  # the legacy logprobs object, with this many alternatives
    prompt_logprobs: int | None  # vLLM's `prompt_logprobs` field, as asked for
    names: TokenText | TokenIds  # how logprobs show a token


def engine_error(error: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """The HTTP error for an exception raised by `AsyncEngine.add_request` or a stream."""
    if isinstance(error, QueueFullError):
        return APIError(429, f"{error}; retry later", "rate_limit_exceeded", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, EngineStoppedError):
        return APIError(503, str(error), "server_error", code="shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, RequestTimeoutError):
        # NOTE: 408, not 504: the request's own time ran out (its request_timeout or the
        # server's --request-timeout), not an upstream's; the error names the field to raise.
        return APIError(408, str(error), "timeout_error", "request_timeout", "request_timeout")
    if isinstance(error, ConstraintFailedError):
        return APIError(400, str(error), "invalid_request_error", code="constraint_failed")
    if isinstance(error, EngineDeadError):
        return APIError(500, str(error), "server_error", code="engine_dead")
    if isinstance(error, EngineError):
        return APIError(500, str(error), "server_error")
    if isinstance(error, ValueError):
        return value_error(error, renames)
    return APIError(500, f"internal error: {error!r}", "server_error")


def value_error(error: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A `ValueError("<field>: message")` from SamplingParams or the engine as a 400."""
    message = str(error)
    field, sep, rest = message.partition(": ")
    param = (renames or {}).get(field, field) if sep and " " not in field else None
    code = "context_length_exceeded" if "context length" in message else None
    return bad_request(f"{param}: {rest}" if param else message, param, code)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    # NOTE: pydantic writes a -inf logprob as null; json.dumps would write invalid JSON.
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEStream:
    """The SSE lines of one streaming response, and the engine requests behind them.

    `aclose()` aborts the requests even if iteration never began (a client gone before the
    first byte), which closing the generator alone would not do.
    """

    def __init__(self, lines: AsyncGenerator[str, None], streams: list[RequestStream]) -> None:
        self._lines = lines
        self._streams = streams

    def __aiter__(self) -> AsyncGenerator[str, None]:
        return self._lines

    async def aclose(self) -> None:
        for stream in self._streams:
            stream.close()
        with contextlib.suppress(RuntimeError):  # still running in a task being cancelled
            await self._lines.aclose()


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(position: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((position, output))
            queue.put_nowait((position, None))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait((position, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


class OpenAIServing:
    """The two generation endpoints over one AsyncEngine. Runs on the event loop only."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
                 max_model_len: int, vocab_size: int,
                 max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_seqs_per_request = max_seqs_per_request
        self.token_text = TokenText(tokenizer)
        # Checks output constraints before they are queued (the engine compiles its own).
        self.grammar_compiler = GrammarCompiler(tokenizer, vocab_size)
        # A token covers at most this many characters of text (its vocabulary string, bytes for
        # a byte-level BPE; x4 leaves room for a normalizer that merges characters), so a longer
        # text cannot fit in the context: it is refused without the cost of tokenizing it.
        longest = max((len(token) for token in tokenizer.hf.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * longest * 4

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                           "model", "model_not_found")

    # ---- shared steps ------------------------------------------------------------------

    async def _output_constraint(self, request: SamplingFields,
                                 tool_plan: ToolPlan | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint, once the grammar engine has accepted it (compiling
        can take long: it runs in a worker thread, and the compiled grammar is cached). A forced
        tool call is one (its errors name `tools`)."""
        found = request.output_constraint()
        forced = tool_plan.structured_outputs() if tool_plan is not None else None
        if forced is not None:
            if found is not None:
                raise bad_request(f"tool_choice: a forced tool call cannot be combined with {found[1]}", "tool_choice")
            found = forced, "tools"
        if found is None:
            return None
        constraint, param = found
        try:
            await asyncio.to_thread(self.grammar_compiler.check, constraint)
        except ValueError as error:
            raise constraint_error(error, param) from None
        return constraint

    def _sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                         renames: dict[str, str], constraint: StructuredOutputsParams | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        bias = None
        if request.logit_bias:
            bias = {}
            for key, value in request.logit_bias.items():
                if not _TOKEN_ID.fullmatch(key) or int(key) >= self.vocab_size:
                    raise bad_request(f"logit_bias: {key[:20]!r} is not a token id in [0, {self.vocab_size})",
                                      "logit_bias")
                bias[int(key)] = value
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(not 0 <= t < self.vocab_size for t in getattr(request, name) or ()):
                raise bad_request(f"{name}: token ids must be in [0, {self.vocab_size})", name)
        fields: dict[str, Any] = {
            "n": request.n, "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k, "min_p": request.min_p, "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty, "repetition_penalty": request.repetition_penalty,
            "logit_bias": bias, "seed": request.seed, "min_tokens": request.min_tokens, "stop": request.stop,
            "stop_token_ids": request.stop_token_ids, "ignore_eos": request.ignore_eos, "logprobs": logprobs,
            "allowed_token_ids": request.allowed_token_ids, "bad_words": request.bad_words,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "skip_special_tokens": request.skip_special_tokens, "structured_outputs": constraint,
            "prompt_logprobs": prompt_logprobs,
        }
        try:
            return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in fields.items() if v is not None})
        except ValueError as error:
            raise value_error(error, renames) from None

    async def _encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, True)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _check_fan_out(self, num_prompts: int, n: int | None) -> None:
        """Refuse a request that would create more than --max-seqs-per-request sequences.

        Called before anything is tokenized or queued: the count comes from the parsed body.
        """
        limit = self.max_seqs_per_request
        if num_prompts > limit:
            raise bad_request(f"prompt: {num_prompts} prompts in one request; this server takes at most "
                              f"{limit} sequences (prompts x n) per request", "prompt")
        if num_prompts * (n or 1) > limit:
            raise bad_request(f"n: {num_prompts} prompt(s) x n={n} would make {num_prompts * (n or 1)} sequences; "
                              f"this server takes at most {limit} per request", "n")

    def _truncate(self, token_ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the last `keep` tokens (-1: as many as leave room in
        the context for max_tokens, or for one token)."""
        if keep is None:
            return token_ids
        if keep == 0 or keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens: must be -1 or in [1, {self.max_model_len}] (the context "
                              f"length), got {keep}", "truncate_prompt_tokens")
        if keep == -1:
            keep = max(1, self.max_model_len - max(max_tokens or 1, 1))
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a prompt whose text is too long to fit in the context whatever its tokens."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt's {num_chars} characters cannot fit in it (at most {self.max_prompt_chars})",
                param, "context_length_exceeded")

    def _check_prompt(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(f"{param}: the prompt encodes to no tokens", param)
        if len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, "
                f"and the prompt has {len(token_ids)} tokens", param, "context_length_exceeded")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"{param}: token ids must be in [0, {self.vocab_size})", param)

    async def _submit(self, request_id: str, prompts: list[_Prompt], params: SamplingParams,
                      renames: dict[str, str], fields: SamplingFields) -> list[RequestStream]:
        """Queue every prompt at once; if any is refused, abort the others and raise.

        Cancelling the caller cancels every `add_request`, each of which aborts its request.
        """
        policy = self.engine.info.scheduling_policy
        if fields.priority and policy != "priority":  # as vLLM: refused rather than ignored
            raise bad_request(f"priority: {fields.priority} needs --scheduling-policy priority "
                              f"(this server schedules {policy}); omit it or send 0", "priority")
        arrival = time.monotonic()
        # Queued time counts: the deadline runs from arrival (None: the server's --request-timeout).
        deadline = None if fields.request_timeout is None else arrival + fields.request_timeout
        # NOTE: every prompt of the request shares one group: the scheduler's fair share treats
        # the whole request as one client.
        results = await asyncio.gather(*(
            self.engine.add_request(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                    prompt.token_ids, params, arrival, group_id=request_id,
                                    priority=fields.priority or 0, deadline=deadline)
            for i, prompt in enumerate(prompts)), return_exceptions=True)
        streams = [result for result in results if isinstance(result, RequestStream)]
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            for stream in streams:
                stream.close()
            if isinstance(errors[0], Exception):
                raise engine_error(errors[0], renames) from None
            raise errors[0]
        return streams

    # ---- /v1/completions ---------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | SSEStream:
        """Queue the request; return the response, or (stream) an iterator of SSE lines.

        Raises APIError before anything is sent when the request cannot be served.
        """
        self.check_model(request.model)
        request.check()
        raw = request.prompt
        items: list[str | list[int]] = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        self._check_fan_out(len(items), request.n)
        prompts = []
        for item in items:
            if isinstance(item, str) and request.truncate_prompt_tokens is None:
                self.check_prompt_chars(len(item), "prompt")
            ids = await self._encode(item) if isinstance(item, str) else list(item)
            kept = self._truncate(ids, request.truncate_prompt_tokens, request.max_tokens)
            self._check_prompt(kept, "prompt")
            prompts.append(_Prompt(item if isinstance(item, str) and kept is ids else None, kept))
        constraint = await self._output_constraint(request)
        # max_tokens 0 (with echo): one token is generated and dropped, as vLLM does.
        params = self._sampling_params(request, request.max_tokens or (None if request.max_tokens is None else 1),
                                       request.logprobs, {}, constraint, request.num_prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(request_id, prompts, params, {}, request)
        if request.echo:
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = self.tokenizer.decode(prompt.token_ids)
        created = int(time.time())
        form = _CompletionForm(bool(request.echo), request.max_tokens == 0, request.logprobs, request.prompt_logprobs,
                               self.token_names(request))
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            lines = self._completion_stream(request_id, created, streams, prompts, params, form, include_usage)
            return SSEStream(lines, streams)
        return await self._completion_full(request_id, created, streams, prompts, params, form)

    def _completion_logprobs(self, deltas: Sequence[TokenLogprobs], num_top: int, offset: int,
                             names: TokenText | TokenIds) -> tuple[CompletionLogprobs, int]:
        """The legacy logprobs object of `deltas` (tokens shown by `names`), their text starting
        at `offset`; and the offset after them."""
        result = CompletionLogprobs()
        for entry in deltas:
            text = names.text(entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            top = {names.text(t): lp for t, lp in entry.top[:num_top]}
            top.setdefault(text, entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result, offset

    def _echo_logprobs(self, prompt: _Prompt, entries: list[TokenLogprobs | None], num_top: int,
                       names: TokenText | TokenIds) -> CompletionLogprobs:
        """An echoed prompt's logprobs object: its first token with null logprobs (nothing
        predicts it), then `entries[1:]`."""
        first = names.text(prompt.token_ids[0])
        rest, _ = self._completion_logprobs([entry for entry in entries[1:] if entry is not None], num_top, len(first),
                                            names)
        return CompletionLogprobs(tokens=[first, *rest.tokens], token_logprobs=[None, *rest.token_logprobs],
                                  top_logprobs=[None, *rest.top_logprobs], text_offset=[0, *rest.text_offset])

    def prompt_logprobs_json(self, entries: list[TokenLogprobs | None] | None,
                             names: TokenText | TokenIds) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt token, its id and the top alternatives' ids ->
        logprob, rank and text."""
        if entries is None:
            return None
        out: PromptLogprobs = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                            "decoded_token": names.text(entry.token_id)}}
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                ranked.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                                  "decoded_token": names.text(token_id)})
            out.append(ranked)
        return out

    def _completion_choice(self, index: int, prompt: _Prompt, completion: CompletionOutput,
                           deltas: list[TokenLogprobs], prompt_entries: list[TokenLogprobs | None] | None,
                           form: _CompletionForm) -> CompletionChoice:
        """One completion's whole choice: with echo the prompt first (its text, and its logprobs
        when `logprobs` was asked for), then the new text."""
        text, deltas = ("", []) if form.echo_only else (completion.text, deltas)
        prefix = (prompt.text or "") if form.echo else ""
        lp = None
        if form.logprobs is not None:
            lp = self._echo_logprobs(prompt, prompt_entries or [], form.logprobs, form.names) \
                if form.echo else CompletionLogprobs()
            rest, _ = self._completion_logprobs(deltas, form.logprobs, len(prefix), form.names)
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lp, key).extend(getattr(rest, key))
        prompt_logprobs = self.prompt_logprobs_json(prompt_entries, form.names) \
            if form.prompt_logprobs is not None else None
        return CompletionChoice(index=index, text=prefix + text, logprobs=lp, finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason, prompt_logprobs=prompt_logprobs)

    async def _completion_full(self, request_id: str, created: int, streams: list[RequestStream],
                               prompts: list[_Prompt], params: SamplingParams,
                               form: _CompletionForm) -> CompletionResponse:
        prompt_entries: dict[int, list[TokenLogprobs | None]] = {}
        finals, logprobs = await self.collect(streams, prompt_entries)
        choices = []
        num_completion = 0
        for (i, k), completion in sorted(finals.items()):
            choices.append(self._completion_choice(i * params.n + k, prompts[i], completion, logprobs[(i, k)],
                                                   prompt_entries.get(i), form))
            num_completion += 0 if form.echo_only else len(completion.token_ids)
        usage = self.usage(prompts, num_completion, streams)
        return CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                  choices=choices, usage=usage)

    def _completion_stream(self, request_id: str, created: int, streams: list[RequestStream],
                           prompts: list[_Prompt], params: SamplingParams, form: _CompletionForm,
                           include_usage: bool) -> AsyncGenerator[str, None]:
        def chunk(index: int, text: str, lp: CompletionLogprobs | None = None,
                  finish: str | None = None, stop: int | str | None = None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop)
            return sse(CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                          choices=[choice]))

        offsets: dict[int, int] = {}
        num_tokens: dict[int, int] = {}
        # With logprobs, an echoed prompt waits for its first output: that brings its logprobs.
        echo_now = form.echo and form.logprobs is None

        async def events() -> AsyncGenerator[str, None]:
            if echo_now:
                for i, prompt in enumerate(prompts):
                    for k in range(params.n):
                        offsets[i * params.n + k] = len(prompt.text or "")
                        yield chunk(i * params.n + k, prompt.text or "")
            echoed: set[int] = set()
            async with contextlib.aclosing(merge_streams(streams)) as outputs:
                async for i, output in outputs:
                    for completion in output.outputs:
                        index = i * params.n + completion.index
                        if form.echo and not echo_now and index not in echoed:
                            echoed.add(index)
                            lp = self._echo_logprobs(prompts[i], output.prompt_logprobs or [], form.logprobs or 0,
                                                     form.names)
                            offsets[index] = len(prompts[i].text or "")
                            yield chunk(index, prompts[i].text or "", lp)
                        if form.echo_only:
                            if completion.finish_reason:
                                yield chunk(index, "", None, completion.finish_reason, completion.stop_reason)
                            continue
                        num_tokens[index] = len(completion.token_ids)
                        lp = None
                        if params.logprobs is not None:
                            lp, offsets[index] = self._completion_logprobs(
                                completion.delta_logprobs or [], params.logprobs, offsets.get(index, 0), form.names)
                        if completion.delta_text or completion.finish_reason or (lp and lp.tokens):
                            yield chunk(index, completion.delta_text, lp, completion.finish_reason,
                                        completion.stop_reason if completion.finish_reason else None)

        def usage_chunk() -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=self.served_model_name, choices=[],
                                      usage=self.usage(prompts, sum(num_tokens.values()), streams))

        return self._sse_tail(events(), streams, usage_chunk if include_usage else None)

    # ---- /v1/chat/completions ----------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | SSEStream:
        """As `create_completion`, for a conversation rendered with the model's chat template."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tool_plan = plan_tools(request)
        prompts, params, streams = await self.start_chat(request, request_id, tool_plan)
        created = int(time.time())
        names = self.token_names(request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return SSEStream(self._chat_stream(request_id, created, streams[0], prompts, params, include_usage,
                                               tool_plan, names), streams)
        prompt_entries: dict[int, list[TokenLogprobs | None]] = {}
        finals, logprobs = await self.collect(streams, prompt_entries)
        choices = []
        for (_, k), completion in sorted(finals.items()):
            lp = self._chat_logprobs(logprobs[(0, k)], params.logprobs, names) if params.logprobs is not None else None
            message, finish_reason = AssistantMessage(content=completion.text), completion.finish_reason
            if tool_plan is not None and finish_reason is not None:
                content, calls, finish_reason = tool_plan.answer(completion.text, finish_reason)
                message = AssistantMessage(content=content, tool_calls=calls or None)
            choices.append(ChatChoice(index=k, message=message, logprobs=lp, finish_reason=finish_reason,
                                      stop_reason=completion.stop_reason))
        usage = self.usage(prompts, sum(len(c.token_ids) for c in finals.values()), streams)
        return ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                      choices=choices, usage=usage,
                                      prompt_logprobs=self.prompt_logprobs_json(prompt_entries.get(0), names))

    async def start_chat(self, request: ChatCompletionRequest, request_id: str,
                         tool_plan: ToolPlan | None = None) -> tuple[list[_Prompt], SamplingParams, list[RequestStream]]:
        """Check and render the conversation (offering `tool_plan`'s tools, constrained to a
        forced call), and queue it: its prompt, params and stream.

        Raises APIError before anything is queued when the request cannot be served.
        """
        self.check_model(request.model)
        request.check()
        self._check_fan_out(1, request.n)
        text, ids = await self.render_chat(request, tool_plan, bounded=request.truncate_prompt_tokens is None)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.truncate_prompt_tokens is not None:
            ids = self._truncate(ids, request.truncate_prompt_tokens, max_tokens)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self._check_prompt(ids, "messages")
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        renames = {"max_tokens": request.max_tokens_param, "logprobs": "top_logprobs", "prompt": "messages"}
        constraint = await self._output_constraint(request, tool_plan)
        params = self._sampling_params(request, max_tokens, num_top, renames, constraint, request.prompt_logprobs)
        prompts = [_Prompt(text, ids)]
        return prompts, params, await self._submit(request_id, prompts, params, renames, request)

    async def render_chat(self, request: ChatTemplateFields, tool_plan: ToolPlan | None = None,
                          bounded: bool = True) -> tuple[str, list[int]]:
        """The conversation as prompt text and ids (messages checked by `check_messages`), tool
        calls and results included, with `tool_plan`'s tools offered. `bounded`: refuse text
        too long for the context before rendering it (not when the prompt is to be truncated)."""
        messages, tools = prompt_messages(request.messages, tool_plan, self.tokenizer.chat_template)
        num_chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or []))
        if bounded:
            self.check_prompt_chars(num_chars, "messages")
        render = functools.partial(self.tokenizer.encode_chat, messages, request.add_generation_prompt,
                                   continue_final_message=request.continue_final_message,
                                   chat_template_kwargs=request.chat_template_kwargs, tools=tools)
        try:
            # Message text is encoded as text: only the template's markers become special tokens.
            if num_chars > LONG_TEXT_CHARS:
                return await asyncio.to_thread(render)
            return render()
        except ValueError as error:
            raise value_error(error) from None

    def token_names(self, request: SamplingFields) -> TokenText | TokenIds:
        """How the request's logprobs show a token: its text, or `token_id:<id>`."""
        return TokenIds() if request.return_tokens_as_token_ids else self.token_text

    @staticmethod
    def _chat_logprobs(deltas: Sequence[TokenLogprobs], num_top: int, names: TokenText | TokenIds) -> ChatLogprobs:
        content = []
        for entry in deltas:
            top = [TopLogprob(token=names.text(t), logprob=lp, bytes=names.token_bytes(t))
                   for t, lp in entry.top[:num_top]]
            content.append(TokenLogprob(token=names.text(entry.token_id), logprob=entry.logprob,
                                        bytes=names.token_bytes(entry.token_id), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chat_stream(self, request_id: str, created: int, stream: RequestStream, prompts: list[_Prompt],
                     params: SamplingParams, include_usage: bool, tool_plan: ToolPlan | None,
                     names: TokenText | TokenIds) -> AsyncGenerator[str, None]:
        def chunk(index: int, delta: dict[str, Any], lp: ChatLogprobs | None = None,
                  finish: str | None = None, stop: int | str | None = None) -> str:
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish, stop_reason=stop)
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name,
                                           choices=[choice]))

        num_tokens: dict[int, int] = {}
        tool_streams: dict[int, ToolCallStream] = {}

        async def events() -> AsyncGenerator[str, None]:
            # A forced call has no content: null, as OpenAI streams a tool call.
            first_content = None if tool_plan is not None and tool_plan.mode != "auto" else ""
            for k in range(params.n):
                yield chunk(k, {"role": "assistant", "content": first_content})
            async for output in stream:
                for completion in output.outputs:
                    num_tokens[completion.index] = len(completion.token_ids)
                    lp = None
                    if params.logprobs is not None and completion.delta_logprobs:
                        lp = self._chat_logprobs(completion.delta_logprobs, params.logprobs, names)
                    finish_reason = completion.finish_reason
                    if tool_plan is None:
                        has_text = completion.delta_text or lp is not None
                        deltas = [{"content": completion.delta_text}] if has_text else []
                    else:
                        tool_stream = tool_streams.setdefault(completion.index, tool_plan.stream())
                        deltas = tool_stream.feed(completion.delta_text, finish_reason)
                        finish_reason = tool_stream.finish_reason
                        if lp is not None and not deltas:
                            deltas = [{}]  # logprobs of text held back: sent now, the text later
                    for i, delta in enumerate(deltas):
                        yield chunk(completion.index, delta, lp if i == 0 else None)
                    if finish_reason is not None:
                        yield chunk(completion.index, {}, None, finish_reason, completion.stop_reason)

        def usage_chunk() -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name, choices=[],
                                       usage=self.usage(prompts, sum(num_tokens.values()), [stream]))

        return self._sse_tail(events(), [stream], usage_chunk if include_usage else None)

    @staticmethod
    async def _sse_tail(events: AsyncGenerator[str, None], streams: list[RequestStream],
                        usage_chunk: Callable[[], Any] | None) -> AsyncGenerator[str, None]:
        """`events`, then the usage chunk (when asked for) and `[DONE]`; an engine that stops
        mid-stream ends it with an error event and `[DONE]`, and so does any other failure
        while the events are made (logged with its traceback: a bug), so that a client never
        sees a stream end without either. The request streams are closed however the response
        ends (a client that hangs up included)."""
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
            if usage_chunk is not None:
                yield sse(usage_chunk())
            yield SSE_DONE
        except Exception as error:
            if not isinstance(error, EngineError):
                logger.exception("a stream failed mid-way")
            yield sse(engine_error(error).to_dict())
            yield SSE_DONE
        finally:
            for stream in streams:
                stream.close()

    # ---- helpers -----------------------------------------------------------------------

    async def collect(self, streams: list[RequestStream],
                      prompt_logprobs: dict[int, list[TokenLogprobs | None]] | None = None) -> tuple[
            dict[tuple[int, int], CompletionOutput], dict[tuple[int, int], list[TokenLogprobs]]]:
        """Run streams to the end: the last output of every completion and all its logprobs
        (and into `prompt_logprobs`, each stream's prompt logprobs, when it has them)."""
        finals: dict[tuple[int, int], CompletionOutput] = {}
        logprobs: dict[tuple[int, int], list[TokenLogprobs]] = {}
        try:
            async with contextlib.aclosing(merge_streams(streams)) as outputs:
                async for i, output in outputs:
                    if prompt_logprobs is not None and output.prompt_logprobs is not None:
                        prompt_logprobs[i] = output.prompt_logprobs
                    for completion in output.outputs:
                        finals[(i, completion.index)] = completion
                        logprobs.setdefault((i, completion.index), []).extend(completion.delta_logprobs or [])
        except EngineError as error:
            raise engine_error(error) from None
        finally:
            for stream in streams:
                stream.close()
        return finals, logprobs

    @staticmethod
    def usage(prompts: list[_Prompt], num_completion_tokens: int, streams: list[RequestStream]) -> UsageInfo:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompts' tokens found in the
        prefix cache (one stream per prompt)."""
        num_prompt = sum(len(p.token_ids) for p in prompts)
        details = PromptTokensDetails(cached_tokens=sum(stream.num_cached_tokens for stream in streams))
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt + num_completion_tokens, prompt_tokens_details=details)
