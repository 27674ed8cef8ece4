"""The stored responses behind GET /v1/responses/{id} and previous_response_id: in memory, bounded.

vLLM's store grows without end (its own FIXME); this one keeps the most recently stored MAX_STORED_RESPONSES
and forgets the oldest, so a long-running server's memory stays bounded. A forgotten id reads as unknown.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllmpy.entrypoints.openai.protocol_responses import ResponseObject

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation so far as chat messages, the response's own output last (instructions left out, as
    # OpenAI does not carry them on): what previous_response_id continues.
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_size: int = MAX_STORED_RESPONSES) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def __len__(self) -> int:
        return len(self._entries)
