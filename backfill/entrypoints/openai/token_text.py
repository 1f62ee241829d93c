"""TokenText: how logprobs show a token, as text and as its exact bytes."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backfill.tokenizer import Tokenizer


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


class TokenText:
    """How logprobs show a token: its text, and its raw bytes (cached by token id).

    A token holding part of a UTF-8 character has no text of its own; like OpenAI, it is shown
    as `bytes:\\xNN...`, and `bytes` carries the exact bytes so clients can join them.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.convert_ids_to_tokens([token_id])[0] or ""
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                raw = bytes([int(match.group(1), 16)])
            elif piece and all(ch in _BYTE_DECODER for ch in piece):
                raw = bytes(_BYTE_DECODER[ch] for ch in piece)
            else:
                raw = text.encode("utf-8")
            if "\ufffd" in text and "\ufffd".encode() not in raw:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, list(raw))
        return entry

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def token_bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]


class TokenIds:
    """Tokens shown as `token_id:<id>` (vLLM's `return_tokens_as_token_ids`): exact where a
    token's text is ambiguous or not text at all. Same interface as TokenText."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode())
