"""Reasoning parsing: a model's text split into reasoning_content and content, the same whole or streamed.

Reasoning runs from a start marker at the top of the output (or from the first token, for models whose
template opens it) to an end marker; content follows. Both parts are stripped of the whitespace around
the markers. As with tool parsers, `extract(text, final=False)` holds only what no continuation can
change, and `ReasoningStream` hands out the difference between successive answers.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.base import partial_marker_at


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    start_markers: ClassVar[tuple[str, ...]]
    end_markers: ClassVar[tuple[str, ...]]
    # Whether the markers are special tokens the detokenizer must keep (as for tool parsers).
    keeps_special_tokens: ClassVar[bool] = False
    # Tags some families put around the answer after the reasoning (Hunyuan's <answer>, ERNIE's
    # <response>): not part of the content.
    answer_tags: ClassVar[tuple[str, str] | None] = None

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        # The request's template variables (server defaults under the request's own), e.g. enable_thinking.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def implicit_start(self) -> bool:
        """Whether the output is reasoning from its first token even without a start marker."""
        return False

    def extract(self, text: str, final: bool) -> ReasoningSplit:
        rest = text.lstrip()
        start = next((m for m in self.start_markers if rest.startswith(m)), None)
        if start is not None:
            body = rest[len(start):]
        elif not final and any(m.startswith(rest) for m in self.start_markers):
            return ReasoningSplit()  # may still become a start marker
        elif self.implicit_start():
            body = rest
        else:
            return ReasoningSplit(content=text)
        ends = [(at, m) for m in self.end_markers if (at := body.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            return ReasoningSplit(body[:at].strip(), self._answer(body[at + len(marker):].lstrip(), final))
        if not final:  # hold back what may be the start of an end marker, and trailing whitespace
            body = body[:partial_marker_at(body, self.end_markers)]
        return ReasoningSplit(body.strip())

    def _answer(self, content: str, final: bool) -> str:
        """The content without the answer tags around it; held back while it may still open with them."""
        if self.answer_tags is None:
            return content
        opening, closing = self.answer_tags
        if not content.startswith(opening):
            return "" if not final and opening.startswith(content) else content
        inner = content[len(opening):].lstrip()
        if (at := inner.find(closing)) >= 0:
            return inner[:at].rstrip()
        return inner if final else inner[:partial_marker_at(inner, (closing,))].rstrip()


class ReasoningStream:
    """One choice's output fed as text deltas; each feed returns the reasoning and content new since the last."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._text = ""
        self._sent = ReasoningSplit()

    def feed(self, delta: str, final: bool = False) -> ReasoningSplit:
        self._text += delta
        split = self._parser.extract(self._text, final)
        new = ReasoningSplit(split.reasoning[len(self._sent.reasoning):], split.content[len(self._sent.content):])
        self._sent.reasoning += new.reasoning
        self._sent.content += new.content
        return new
