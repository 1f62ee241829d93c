"""IncrementalDetokenizer: one request's output tokens -> text deltas, cut at stop strings.

Two holds stand between a decoded token and the text a client sees:

  tokens ──▶ [UTF-8 hold] ──▶ decoded text ──▶ [stop-string hold] ──▶ released text ──▶ deltas

- UTF-8 hold (vLLM's prefix_offset / read_offset): each step decodes the window of tokens from
  `prefix_offset` on and keeps only what the tokens after `read_offset` added. A window whose
  text ends in U+FFFD (a character whose bytes are not all there yet) is held back whole until
  a later token completes it, so no delta ever carries a broken character.
- Stop-string hold: the longest tail of the decoded text that could still be the start of a
  stop string is held back, so a stream never shows part of a stop string that is cut later.
  Not needed with include_stop_str_in_output (the stop string is kept either way).

Per step the work is O(new tokens + longest stop string): windows are a few tokens long and
stop strings are searched only in the new text plus the last (max stop length - 1) chars.
"""

from __future__ import annotations

import weakref
from typing import Any

from backfill.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output as context, so that decoders that treat the first
# token of a text specially (SentencePiece drops its leading space) decode output tokens in place.
PROMPT_CONTEXT_TOKENS = 5
# Token strings before prefix_offset are never read again; drop them once this many pile up.
_TRIM_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"

_special_ids_cache: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the special-tokens map and every
    added token flagged special (a GGUF tokenizer flags more than its named specials)."""
    try:
        return _special_ids_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    result = frozenset(ids)
    try:
        _special_ids_cache[tokenizer] = result
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return result


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step, and watches its stop strings.

    Works with any transformers fast tokenizer (`convert_ids_to_tokens`,
    `convert_tokens_to_string`, `all_special_ids`). The concatenation of every delta equals the
    decode of all output tokens fed in (with the request's skip_special_tokens), up to a stop
    string. Feed a stop token id only if its text should appear (vLLM leaves a stop token's text
    out); EOS and other special tokens vanish anyway with skip_special_tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = special_token_ids(tokenizer) if params.skip_special_tokens else frozenset()
        self._stop_strings = list(params.stop_list)
        self._include_stop = params.include_stop_str_in_output
        # Stop strings are looked for only in text after the first min_tokens tokens (vLLM's rule)
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)

        # Token strings: prompt context, then output. Invariant: the text of
        # tokens[prefix_offset:read_offset] has been decoded (and is a complete-character text).
        context_ids: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context_ids) == PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._skip_ids:
                context_ids.append(token_id)
        context = self._to_tokens(context_ids[::-1])
        if context and tokenizer.convert_tokens_to_string(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: decoding output after it would swallow text
        self._tokens: list[str] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

        # Invariant: no stop string can start in released text except where it is kept whole
        # (include_stop_str_in_output); `_pending` is decoded but unreleased, `_tail` the last
        # (max stop length - 1) chars of all decoded text, which ends with `_pending`.
        self._pending = ""
        self._tail = ""
        self._released: list[str] = []  # chunks of released text, joined lazily
        self._delta: list[str] = []  # chunks released since the last get_delta()
        self._stop_str: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far: safe to show, never changes except by appending."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop_str

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def include_stop(self) -> bool:
        """include_stop_str_in_output: a stop string's, or a stop token's, text is kept."""
        return self._include_stop

    def get_delta(self) -> str:
        """Text released since the previous call: what a stream sends now."""
        delta = "".join(self._delta)
        self._delta.clear()
        return delta

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Decode new output tokens. Returns the stop string if one matched; the text is then cut
        before it (or after it, with include_stop_str_in_output) and the detokenizer is finished."""
        assert not self._finished, "add_tokens after the detokenizer finished"
        free: list[str] = []  # text of the first min_tokens tokens: no stop string ends in it
        checked: list[str] = []
        for token_id in token_ids:
            self._num_tokens += 1
            (free if self._num_tokens <= self._min_tokens else checked).append(self._decode_next(token_id))
        if free:
            self._release("".join(free))
            self._tail = ""  # nothing before min_tokens starts a stop string either
        new_text = "".join(checked)
        if new_text:
            self._accept(new_text, final=False)
        return self._stop_str

    def flush(self) -> str:
        """The request ended another way (EOS, stop token, length, abort): release everything held.

        Text held for an incomplete character is released as decoded (with U+FFFD), still
        checked for stop strings. Returns the text this call released; it also appears in the
        next get_delta(). Idempotent: later calls return "".
        """
        if self._finished:
            return ""
        rest = ""
        if self._read_offset < len(self._tokens):
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            full_text = self._decode(self._prefix_offset, len(self._tokens))
            rest = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._tokens)
        before = len(self._delta)
        self._accept(rest, final=True)
        self._finished = True
        return "".join(self._delta[before:])

    # -- UTF-8 hold -----------------------------------------------------------------------------

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        if self._skip_ids:
            token_ids = [t for t in token_ids if t not in self._skip_ids]
        if not token_ids:
            return []
        tokens: list[str] = self._tokenizer.convert_ids_to_tokens(token_ids)
        return tokens

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        text: str = self._tokenizer.convert_tokens_to_string(self._tokens[start:end])
        return text

    def _decode_next(self, token_id: int) -> str:
        """Text that `token_id` completes (maybe with earlier held tokens), or "" while held."""
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:
            return ""
        self._tokens.extend(new_tokens)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._tokens))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._prefix_offset >= _TRIM_TOKENS:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    # -- stop-string hold -----------------------------------------------------------------------

    def _accept(self, new_text: str, final: bool) -> None:
        """Release decoded text, holding back a possible stop-string start unless `final`."""
        if not self._stop_strings:
            self._release(new_text)
            return
        # Search only where a stop string could end: the tail of earlier text plus the new text.
        text = self._tail + new_text
        unreleased_start = len(self._tail) - len(self._pending)
        match = self._find_stop(text, first_end=len(self._tail) + 1)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            assert end >= unreleased_start, "a stop string started in text already released"
            self._release(text[unreleased_start:end])
            self._pending, self._tail = "", ""
            self._stop_str = stop
            self._finished = True
            return
        hold = 0 if final or self._include_stop else self._stop_prefix_len(text, len(text) - unreleased_start)
        self._release(text[unreleased_start : len(text) - hold])
        self._pending = text[len(text) - hold :] if hold else ""
        keep = self._max_stop_len - 1
        self._tail = text[-keep:] if keep > 0 else ""

    def _find_stop(self, text: str, first_end: int) -> tuple[int, str] | None:
        """The stop string in `text` that ends first, at or after `first_end` chars; on a tie the
        longer one. This is what feeding the text one character at a time would find, so the cut
        does not depend on how the text was split into tokens."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop_strings:
            index = text.find(stop, max(0, first_end - len(stop)))
            if index >= 0:
                candidate = (index + len(stop), -len(stop), stop)
                best = candidate if best is None or candidate < best else best
        return None if best is None else (best[0] + best[1], best[2])

    def _stop_prefix_len(self, text: str, limit: int) -> int:
        """Length of the longest suffix of `text` (at most `limit` chars) that starts a stop string."""
        for length in range(min(limit, self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop_strings):
                return length
        return 0

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
            self._delta.append(text)
