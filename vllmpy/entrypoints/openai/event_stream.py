"""A stream of typed server-sent events, as the Responses and Anthropic Messages APIs send them: each event is
a JSON object whose `type` is also its `event:` line, and a failure mid-stream ends it with the API's own
error event (the server frames it; see api_server._event_sse). Neither API sends OpenAI's `[DONE]`."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from vllmpy.entrypoints.openai.protocol import ErrorInfo

Event = dict[str, Any]


@dataclass
class EventStream:
    events: AsyncIterator[Event]
    error_event: Callable[[ErrorInfo], Event]  # the event that reports a failure, in the API's shape


def frame(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
