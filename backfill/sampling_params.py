"""SamplingParams: how one request turns logits into tokens, and when it stops."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# bad_words: checked against every sequence's output at every step, so bounded.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 8192
# A grammar's source text (a JSON schema once serialized, a regex, a Lark/GBNF grammar, the
# choices together): what one request may ask the grammar engine to compile. Compiling is
# bounded by llguidance's parser limits too (`backfill/structured_output`).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _is_token_ids(value: object) -> bool:
    """A list of non-negative ints (bools are not token ids)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `structured_outputs`): exactly one field is set.

    `json`: a JSON schema (a dict or its text); `json_object`: any JSON object; `regex`: a
    regular expression the whole output matches; `choice`: one of these strings, exactly;
    `grammar`: a Lark or GBNF (llama.cpp) grammar. An invalid value raises `ValueError` whose
    message starts with `structured_outputs.<field>`. A grammar that is well-formed here but
    that the grammar engine rejects (an unsupported schema keyword, a bad regex) is found when
    it is compiled (`backfill.structured_output.check_grammar`).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            _fail("structured_outputs", "set exactly one of json, regex, choice, grammar, json_object"
                  + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as error:
                    _fail("structured_outputs.json", f"not valid JSON: {error}")
                if not isinstance(schema, (dict, bool)):
                    _fail("structured_outputs.json", "a JSON schema must be an object")
            elif not isinstance(self.json, dict):
                _fail("structured_outputs.json", "must be a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured_outputs.{name}", "must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                _fail("structured_outputs.choice", "must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                _fail("structured_outputs.choice", f"at most {MAX_CHOICES} choices, got {len(self.choice)}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("structured_outputs.json_object", "must be a boolean")
        kind, text = self.source()
        if len(text) > MAX_GRAMMAR_CHARS:
            _fail(f"structured_outputs.{kind}", f"longer than {MAX_GRAMMAR_CHARS} characters")

    def source(self) -> tuple[str, str]:
        """(the field that is set, its text): what is compiled, and the key compiled grammars
        are cached under."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass
class SamplingParams:
    """User-facing sampling parameters, validated on creation.

    An invalid value raises `ValueError` whose message starts with the field's name
    (`"temperature: must be >= 0, got -1"`), so the server can report it as the `param`.
    `temperature == 0` means greedy. `top_k` of 0 or -1 disables top-k.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): each word's tokens, with and without a leading
    # space, are `bad_words_token_ids` (set from the tokenizer by the InputProcessor); a word's
    # last token is masked whenever the output ends with the tokens before it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    logprobs: int | None = None  # top-N alternatives per generated token (0: chosen token only)
    # Logprobs of the prompt's own tokens (each after the first), with top-N alternatives (0: the
    # prompt token only). Costs the LM head on every prompt position; such a request computes
    # its whole prompt (no prefix-cache hit), as vLLM does.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding: the output matches this grammar (None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)
    # NOTE: checked after every token of every sequence: a set keeps a long list cheap.
    stop_token_id_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_int("n", self.n, minimum=1, maximum=128)
        self._check_number("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        self._check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        self._check_int("top_k", self.top_k, minimum=-1, maximum=2**63 - 1)
        self._check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check_number(name, value)
            if not -2 <= value <= 2:
                _fail(name, f"must be in [-2, 2], got {value}")
        self._check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 10:
            _fail("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", "must be a mapping of token id to bias")
            clean: dict[int, float] = {}
            for key, bias in self.logit_bias.items():
                try:
                    token_id = int(key)
                except (TypeError, ValueError):
                    _fail("logit_bias", f"keys must be token ids, got {key!r}")
                self._check_number("logit_bias", bias)
                if token_id < 0 or not -100 <= bias <= 100:
                    _fail("logit_bias", f"token id must be >= 0 and bias in [-100, 100], got {key}: {bias}")
                clean[token_id] = float(bias)
            self.logit_bias = clean
        if self.seed is not None:
            self._check_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1)
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, minimum=1)
        self._check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop):
            self.stop_list = list(self.stop)
        else:
            _fail("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop_list):
            _fail("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None and not _is_token_ids(self.stop_token_ids):
            _fail("stop_token_ids", "must be a list of non-negative token ids")
        self.stop_token_id_set = frozenset(self.stop_token_ids or ())
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                _fail("bad_words", "must be a list of non-blank strings")
            if len(self.bad_words) > MAX_BAD_WORDS or sum(len(w) for w in self.bad_words) > MAX_BAD_WORDS_CHARS:
                _fail("bad_words", f"at most {MAX_BAD_WORDS} words of {MAX_BAD_WORDS_CHARS} characters together")
        if self.bad_words_token_ids is not None and (not isinstance(self.bad_words_token_ids, list) or not all(
                word and _is_token_ids(word) for word in self.bad_words_token_ids)):
            _fail("bad_words_token_ids", "must be a list of non-empty lists of non-negative token ids")
        if self.allowed_token_ids is not None and not (self.allowed_token_ids and _is_token_ids(self.allowed_token_ids)):
            _fail("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "must be a boolean")
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @staticmethod
    def _check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(name, f"must be an integer, got {value!r}")
        assert isinstance(value, int)
        if minimum is not None and value < minimum:
            _fail(name, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            _fail(name, f"must be <= {maximum}, got {value}")

    @staticmethod
    def _check_number(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            _fail(name, f"must be a number, got {value!r}")
