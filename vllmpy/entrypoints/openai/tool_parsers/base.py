"""Tool-call parsing: a model's text in, (content, tool calls) out, the same whether whole or streamed.

A parser is one pure function, `extract(text, final)`. With final=False `text` is the output so far and
the answer holds only what no continuation can change: content before any possible call marker, calls
whose names are complete, argument text so far. `ToolCallStream` turns successive answers into OpenAI
delta pieces; the non-streaming route feeds the same stream once with final=True, so the two paths
share one parse and cannot disagree.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class CallDraft:
    """One call as far as the text shows it; `arguments` is JSON text, a prefix of the final text until complete."""

    name: str | None  # None until the whole name has been written
    arguments: str = ""
    complete: bool = False
    id: str | None = None  # the model's own call id, for formats that write one (Kimi K2)


@dataclass
class Extraction:
    content: str
    calls: list[CallDraft] = field(default_factory=list)


class ToolSyntaxError(ValueError):
    """The call section does not follow the parser's format; the whole output is then content."""


class ToolParser(ABC):
    # Whether the format's markers are special tokens the detokenizer must keep (the server then sets
    # skip_special_tokens=False for requests this parser reads, as vLLM does).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # The request's tools: formats that write argument values as bare text (the XML families) read
        # each parameter's JSON-schema type from them, as vLLM does.
        self._properties = {tool["function"]["name"]: (tool["function"].get("parameters") or {}).get("properties")
                            or {} for tool in tools or [] if "function" in tool}

    def parameter_schema(self, function: str, parameter: str) -> dict[str, Any] | None:
        """The declared JSON schema of one parameter, or None when the request does not declare it."""
        schema = self._properties.get(function, {}).get(parameter)
        return schema if isinstance(schema, dict) else None

    @abstractmethod
    def extract(self, text: str, final: bool) -> Extraction:
        """Content and calls of `text`; with final=False only what every continuation of `text` keeps."""

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


class SectionToolParser(ToolParser):
    """The common shape: content, then a marker opening a section of calls that runs to the end.

    Subclasses name the markers and read the section; a section that breaks the format makes the whole
    output content (as vLLM does), and text after the last call is dropped.
    """

    markers: ClassVar[tuple[str, ...]] = ()
    # True when calls must open the output (after whitespace); no content may precede them.
    leading_only: ClassVar[bool] = False
    # Markers that open a section only at the output's start, beside `markers` that open one anywhere.
    leading_markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        """The calls of the section whose marker starts at text[at]; ToolSyntaxError if it is malformed."""

    def extract(self, text: str, final: bool) -> Extraction:
        at = self._section_start(text)
        if at is None:
            return Extraction(text if final else self._held_content(text))
        content = text[:at].rstrip()
        try:
            calls = self.parse_calls(text, at)
        except ToolSyntaxError:
            return Extraction(text if final else content)
        if final and not valid_calls(calls):
            return Extraction(text)
        return Extraction(content, calls)

    def _leading(self) -> tuple[str, ...]:
        return self.markers if self.leading_only else self.leading_markers

    def _section_start(self, text: str) -> int | None:
        lead = len(text) - len(text.lstrip())
        if text.startswith(self._leading(), lead):
            return lead
        if self.leading_only:
            return None
        found = [i for marker in self.markers if (i := text.find(marker)) >= 0]
        return min(found) if found else None

    def _held_content(self, text: str) -> str:
        """Content that stays content whatever follows: not a marker's beginning, nor trailing whitespace
        (stripped when a call follows)."""
        rest = text.lstrip()
        if any(marker.startswith(rest) for marker in self._leading()):
            return ""
        if self.leading_only:
            return text
        return text[:partial_marker_at(text, self.markers)].rstrip()


def partial_marker_at(text: str, markers: Iterable[str]) -> int:
    """Where a suffix of `text` that may still grow into one of `markers` begins; len(text) if none does."""
    markers = tuple(markers)
    longest = max(len(marker) for marker in markers)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(marker.startswith(tail) for marker in markers):
            return start
    return len(text)


def valid_calls(calls: list[CallDraft]) -> bool:
    """At the end: at least one call, each named, closed, with a JSON object for arguments."""
    if not calls:
        return False
    for call in calls:
        if call.name is None or not call.complete:
            return False
        try:
            if not isinstance(json.loads(call.arguments), dict):
                return False
        except json.JSONDecodeError:
            return False
    return True


@dataclass
class ToolCallDelta:
    """A piece of one call: its first piece carries the id and name, later ones only argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    """One choice's output fed as text deltas; each feed returns what became certain since the last."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self._parser = parser
        self._max_calls = max_calls  # parallel_tool_calls=false keeps the first call only
        self._text = ""
        self._content_sent = 0
        self._arguments_sent: list[int] = []  # per call index

    @property
    def called(self) -> bool:
        return bool(self._arguments_sent)

    def feed(self, delta: str, final: bool = False) -> ToolDelta:
        self._text += delta
        found = self._parser.extract(self._text, final)
        out = ToolDelta(content=found.content[self._content_sent:])
        self._content_sent = max(self._content_sent, len(found.content))
        for index, call in enumerate(found.calls[:self._max_calls]):
            if call.name is None:
                break  # later calls wait for this one's name, so indexes go out in order
            if index == len(self._arguments_sent):
                self._arguments_sent.append(len(call.arguments))
                call_id = call.id or self._parser.new_call_id()
                out.tool_calls.append(ToolCallDelta(index, call.arguments, call_id, call.name))
            elif len(call.arguments) > self._arguments_sent[index]:
                out.tool_calls.append(ToolCallDelta(index, call.arguments[self._arguments_sent[index]:]))
                self._arguments_sent[index] = len(call.arguments)
        return out
