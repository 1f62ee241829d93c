"""Grammar source -> llguidance matcher: compiled once per distinct grammar, cached.

llguidance was chosen over xgrammar by measurement (`python -m backfill.bench.grammar_engines`,
figures in `BENCHMARKS.md`, "Structured output"): it installs as one wheel with no dependencies
(xgrammar pulls triton, ~290 MB, on Linux) and compiles schemas ~10x faster (2-5 ms against
19-27 ms); xgrammar's mask is faster (5 against 21 us a row), but at 16 constrained rows that is
0.3 ms of a ~60 ms CPU decode step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from backfill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from backfill.tokenizer import Tokenizer

# JSON output is compact and canonical (`json.dumps` separators): no free whitespace, so a model
# cannot loop on spaces or newlines between tokens until max_tokens (a common failure of
# unconstrained-whitespace JSON grammars with small models).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiled grammars kept (LRU): each holds its lexer states, built lazily as tokens arrive
# (llguidance bounds them: at most 250k states of ~1-2 kB per grammar).
DEFAULT_CACHE_SIZE = 64


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`. Raises ValueError("structured_outputs.<field>: ...")
    when the source cannot be turned into one (invalid JSON, an unparsable GBNF grammar)."""
    import llguidance

    kind, source = params.source()
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(choice) for choice in params.choice or ())
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", source)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        raise ValueError(f"structured_outputs.{kind}: {error}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer; thread-safe, so compiles can run off the hot path.

    `matcher(params)` returns a fresh matcher (a copy of the cached compiled one: a copy costs
    microseconds, a compile milliseconds to seconds). Raises ValueError naming the field when the
    grammar engine rejects the grammar; rejected grammars are cached too.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._hf = tokenizer.hf
        self._eos_token_ids = list(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.num_compiles = 0  # cache misses (for tests and metrics)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
            return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the grammar engine's view of the tokenizer now (~0.3 s holding the GIL), so the
        first constrained request does not wait for it."""
        self.ll_tokenizer  # noqa: B018 (built on first use)

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        return self._compiled(params).deep_copy()

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError("structured_outputs.<field>: ...") if the grammar cannot be used:
        rejected when compiled, or given up on before the first token (a copy computes the first
        mask; bounded by the parser limits, see grammar_text). No torch: the API server's process
        runs this, and importing torch there (~2.5 s, holding the GIL) stalled every stream it
        served on its first constrained request."""
        matcher = self._compiled(params).deep_copy()
        matcher.compute_bitmask()  # (drops the GIL)
        if matcher.is_error():
            kind, _ = params.source()
            raise ValueError(f"structured_outputs.{kind}: the grammar engine gave up on it: "
                             f"{matcher.get_error().splitlines()[0]}")

    def _compiled(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The cached compiled matcher (compiled now on a miss); not to be advanced."""
        key = params.source()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile(params)
            with self._lock:
                self._cache[key] = cached
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise ValueError(cached)
        return cached

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher | str:
        """The compiled matcher, or the error message if the grammar is rejected."""
        import llguidance

        try:
            grammar = grammar_text(params)
        except ValueError as error:
            return str(error)
        self.num_compiles += 1
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # drops the GIL
        if matcher.is_error():
            kind, _ = params.source()
            return f"structured_outputs.{kind}: the grammar engine rejected it: {matcher.get_error()}"
        return matcher
