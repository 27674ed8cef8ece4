"""OpenAI harmony (gpt-oss) read from text: the output is a run of messages,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

each with a header (role, `<|channel|>` name, ` to=functions.NAME` recipient, `<|constrain|>json` type)
and a body up to <|end|>, <|call|> or <|return|>. Shared by the `openai` tool and reasoning parsers.
With final=False a body is held back where it ends in what may be the start of a marker.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vllmpy.entrypoints.openai.tool_parsers.base import partial_marker_at

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
_OPENERS = (START, CHANNEL)
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
_MARKERS = _OPENERS + _BODY_ENDS + (MESSAGE, CONSTRAIN)
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Message:
    channel: str | None
    recipient: str | None
    body: str
    closed: bool  # its end marker has been written
    raw: str  # the message as written (header, body so far, end marker)


@dataclass
class Segment:
    """Text outside any message, or one message whose header is complete."""

    text: str = ""
    message: Message | None = None


def segments(text: str, final: bool) -> list[Segment]:
    """The output as plain text and messages, in order; a message whose header is unfinished is left out."""
    out: list[Segment] = []
    i = 0
    while i < len(text):
        found = [j for marker in _OPENERS if (j := text.find(marker, i)) >= 0]
        if not found:
            tail = text[i:] if final else text[i:partial_marker_at(text[i:], _MARKERS) + i]
            out.append(Segment(tail))
            break
        start = min(found)
        if start > i:
            out.append(Segment(text[i:start]))
        body_at = text.find(MESSAGE, start)
        if body_at < 0:
            break
        header = text[start:body_at]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        b = body_at + len(MESSAGE)
        ends = [(j, marker) for marker in _BODY_ENDS if (j := text.find(marker, b)) >= 0]
        if ends:
            end, marker = min(ends)
            i = end + len(marker) if marker in (END, CALL, RETURN) else end
            body, closed, raw = text[b:end], True, text[start:i]
        else:
            end = len(text) if final else b + partial_marker_at(text[b:], _MARKERS)
            i, body, closed, raw = len(text), text[b:end], False, text[start:end]
        out.append(Segment(message=Message(channel.group(1) if channel else None,
                                           recipient.group(1) if recipient else None, body, closed, raw)))
    return out
