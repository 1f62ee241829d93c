"""The Responses API's store: responses kept in memory, so a later request can continue one
(`previous_response_id`) and clients can read (`GET /v1/responses/{id}`, its input items) or
delete one.

A stored response keeps its whole conversation as input items (the earlier turns' items, its
own input, its output), so continuing it needs nothing else: an entry costs about its
conversation's JSON, and the store holds at most `max_bytes` of them (and `max_entries`),
dropping the least recently used first. It is per process: nothing survives a restart, and
with `--replicas` each replica keeps its own (a continuation must reach the replica that
answered; with one replica it always does).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 4096  # `backfill serve --max-stored-responses`; 0: nothing is stored
DEFAULT_MAX_BYTES = 256 * 2**20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as sent (completed or incomplete)
    input_items: list[dict[str, Any]]  # this request's own input items, each with an id
    conversation: list[dict[str, Any]]  # every turn's items: earlier ones, this input, this output
    size: int  # bytes of JSON the entry holds, about


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation)) + len(json.dumps(input_items))
        if size > self.max_bytes:
            return  # too large to keep at all
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, input_items, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
