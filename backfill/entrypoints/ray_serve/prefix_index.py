"""PrefixIndex: which replica has seen which prompt prefixes (an approximation of their caches).

The router cannot see the replicas' KV caches, so, as SGLang's router and ray.serve.llm's
prefix-aware router do, it remembers the text it sent to each replica. Text is cut into blocks of
BLOCK_CHARS characters and each block is keyed by a hash of everything up to its end (a hash chain,
as the engine keys its KV blocks), so a replica's match for a prompt is its run of leading blocks.
Each replica keeps at most `max_blocks_per_replica` blocks, least recently used evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

BLOCK_CHARS = 32
MAX_BLOCKS_PER_REPLICA = 100_000  # ~3 MB of prompt text each


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, for prefix matching ("" when there is none):
    completions' prompt (token ids written out; a batch's first prompt), chat messages (role and
    content), responses' instructions and input."""
    if path.endswith("/chat/completions"):
        return "".join(f"{message.get('role', '')}:{_text(message.get('content'))}\n"
                       for message in body.get("messages") or [] if isinstance(message, dict))
    if path.endswith("/responses"):
        return _text(body.get("instructions")) + _text(body.get("input"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return _text(prompt[0])  # a batch: its first prompt (the others' prefixes may differ)
    return _text(prompt)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value},"
    if isinstance(value, list):
        return "".join(_text(item) for item in value)
    if isinstance(value, dict):
        return _text(value.get("text", value.get("content")))
    return ""


def block_hashes(text: str) -> list[bytes]:
    """One hash per full BLOCK_CHARS block of `text`, each over the text up to the block's end."""
    hashes, previous = [], b""
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = hashlib.blake2b(previous + text[start:start + BLOCK_CHARS].encode(), digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per replica, the blocks of text routed to it; replicas are any hashable ids."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self._blocks: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._max_blocks = max_blocks_per_replica

    def match(self, hashes: Sequence[bytes], replica_ids: Sequence[Hashable]) -> dict[Hashable, int]:
        """How many leading blocks of the prompt each replica has seen (0 for unknown ones)."""
        matched = {}
        for replica_id in replica_ids:
            blocks = self._blocks.get(replica_id, OrderedDict())
            num = 0
            while num < len(hashes) and hashes[num] in blocks:
                num += 1
            matched[replica_id] = num
        return matched

    def insert(self, hashes: Sequence[bytes], replica_id: Hashable) -> None:
        """Record that `replica_id` now holds these blocks (most recently used)."""
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self._max_blocks:
            blocks.popitem(last=False)

    def num_blocks(self, replica_id: Hashable) -> int:
        return len(self._blocks.get(replica_id, ()))

    def remove(self, replica_id: Hashable) -> None:
        """Forget a replica (it died: a restarted one starts with an empty cache)."""
        self._blocks.pop(replica_id, None)
