"""InputProcessor: a user's prompt and parameters -> validated `EngineCoreRequest`s.

Runs in the front end (the server's event loop, or `LLMEngine` offline), so the core only ever
receives token ids in its vocabulary and lengths that fit its context: every rejection is a
`ValueError("<field>: ...")` raised to the caller before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from backfill.engine.messages import CoreInfo, EngineCoreRequest
from backfill.sampling_params import SamplingParams
from backfill.tokenizer import Tokenizer


@dataclass
class ProcessedRequest:
    """One user request: its prompt, and the n sequences to send to the core."""

    request_id: str
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[EngineCoreRequest]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = tuple(dict.fromkeys(info.eos_token_ids + tokenizer.eos_token_ids))

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float,
                priority: int = 0, group_id: str | None = None, deadline: float | None = None) -> ProcessedRequest:
        """Tokenize and check; split an n > 1 request into sequences `<id>#<i>` (seed + i each).

        `group_id` names the client request it belongs to (the server gives every prompt of one
        HTTP request the same): the scheduler shares slots fairly between groups. Default: the
        request is a group of its own, its n sequences included. `priority`: lower first (see
        `Scheduler`). `deadline` (time.monotonic()): the core ends the request then ("timeout");
        None: the core's --request-timeout after arrival, if set.
        """
        prompt_text, prompt_token_ids = self._encode_prompt(prompt)
        self._check_lengths(prompt_token_ids, params)
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        bad_words = [t for word in params.bad_words_token_ids or [] for t in word]
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words_token_ids", bad_words)):
            for token_id in ids:
                if token_id >= self.vocab_size:
                    raise ValueError(f"{name}: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        self._check_some_token_allowed(params)
        sequences = []
        for index in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                seq_params = replace(params, seed=params.seed + index)
            sequences.append(EngineCoreRequest(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=prompt_token_ids,
                params=seq_params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival_time,
                priority=priority,
                group_id=group_id or request_id,
                deadline=deadline,
            ))
        return ProcessedRequest(request_id, prompt_text, prompt_token_ids, params, arrival_time, sequences)

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids must leave a token to sample: not all banned by one-token bad_words,
        nor all stop tokens while min_tokens holds them off (the sampler would have to take a
        token outside the list)."""
        if not params.allowed_token_ids:
            return
        allowed = set(params.allowed_token_ids)
        if allowed <= {word[0] for word in params.bad_words_token_ids or [] if len(word) == 1}:
            raise ValueError("allowed_token_ids: every allowed token is one of bad_words")
        if params.min_tokens > 0:
            held = set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if allowed <= held:
                raise ValueError("allowed_token_ids: only stop tokens are allowed, and min_tokens holds them off")

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as written and after a space (the word mid-text), as vLLM bans them."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not token_ids:
                raise ValueError("prompt: encodes to no tokens")
            return prompt, token_ids
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: must be a non-empty string or list of token ids")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"prompt: token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"prompt: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return None, list(prompt)

    def _check_lengths(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, "
                f"and the prompt has {num_prompt} tokens (at least one must be left to generate)"
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + params.max_tokens} tokens "
                f"({num_prompt} in the prompt, {params.max_tokens} for the completion)"
            )
        # NOTE: min_tokens holds off EOS; past the room left it would run to the full context.
        room = self.max_model_len - num_prompt
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                f"the {num_prompt}-token prompt leaves room for {room}, fewer than min_tokens "
                f"({params.min_tokens})"
            )
