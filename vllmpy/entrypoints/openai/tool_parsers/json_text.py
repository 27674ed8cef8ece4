"""JSON that may still be growing: where a value ends (or that it has not yet), and calls read from objects.

Values are kept as spans of the model's text, not re-serialized, so the argument text streamed so far is
always a prefix of the final arguments.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError

_WHITESPACE = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[^\s,\]}]+")

Span = tuple[int, int | None]  # value start, and its end once written


def skip_ws(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at text[i], or None while the text ends inside it.

    Only the extent is found; json.loads checks the value once it is complete.
    """
    if i >= len(text):
        return None
    if text[i] == '"':
        string = _STRING.match(text, i)
        return string.end() if string else None
    if text[i] not in "{[":
        scalar = _SCALAR.match(text, i)
        if scalar is None:
            raise ToolSyntaxError(f"expected a JSON value at {text[i:i + 10]!r}")
        return scalar.end() if scalar.end() < len(text) else None  # a number may still grow
    return balanced_end(text, i, _STRUCTURAL, _STRING, "{[")


def next_item(text: str, end: int) -> int:
    """Where the next element of a list starts after an element ending at `end` (or where `]` is)."""
    j = skip_ws(text, end)
    if text.startswith(",", j):
        return skip_ws(text, j + 1)
    if j < len(text) and text[j] != "]":
        raise ToolSyntaxError(f"expected ',' or ']' at {text[j:j + 10]!r}")
    return j


def balanced_end(text: str, i: int, structural: re.Pattern, string: re.Pattern, openers: str) -> int | None:
    """Index just past the bracket closing the one at text[i], skipping strings; None while text ends first.

    `structural` finds quotes and brackets, `string` matches a whole string literal at a quote.
    """
    depth = 0
    j = i
    while (mark := structural.search(text, j)) is not None:
        j = mark.end()
        if mark.group() in "'\"":
            literal = string.match(text, mark.start())
            if literal is None:
                return None
            j = literal.end()
        elif mark.group() in openers:
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return j
    return None


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolSyntaxError(f"invalid JSON {text[:40]!r}: {exc}") from None


def object_fields(text: str, i: int) -> tuple[dict[str, Span], int | None]:
    """The fields of the object opening at text[i] so far, and the object's end once written."""
    fields: dict[str, Span] = {}
    j = skip_ws(text, i + 1)
    if text.startswith("}", j):
        return fields, j + 1
    while j < len(text):
        if text[j] != '"':
            raise ToolSyntaxError(f"expected an object key at {text[j:j + 10]!r}")
        key_end = value_end(text, j)
        if key_end is None:
            break
        key = loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise ToolSyntaxError(f"expected ':' after key {key!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        fields[key] = (j, end)
        if end is None:
            break
        j = skip_ws(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise ToolSyntaxError(f"expected ',' or '}}' at {text[j:j + 10]!r}")
        j = skip_ws(text, j + 1)
    return fields, None


def call_from_object(text: str, i: int, argument_keys: tuple[str, ...]) -> tuple[CallDraft, int | None]:
    """A call written as {"name": ..., <argument key>: {...}} at text[i], and the object's end once written."""
    fields, end = object_fields(text, i)
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, stop = fields["name"]
        name = loads(text[start:stop])
        if not isinstance(name, str):
            raise ToolSyntaxError(f"a call's name must be a string, got {name!r}")
    key = next((k for k in argument_keys if k in fields), None)
    if key is None:
        arguments = "{}" if end is not None else ""
    else:
        start, stop = fields[key]
        arguments = text[start:stop]
    return CallDraft(name, arguments, complete=end is not None), end


def calls_in_array(text: str, i: int, argument_keys: tuple[str, ...]) -> list[CallDraft]:
    """Calls of the array of call objects opening at text[i]; a missing ']' at the end is forgiven."""
    calls: list[CallDraft] = []
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] != "]":
        if text[j] != "{":
            raise ToolSyntaxError(f"expected a call object at {text[j:j + 10]!r}")
        call, end = call_from_object(text, j, argument_keys)
        calls.append(call)
        if end is None:
            break
        j = next_item(text, end)
    return calls


class MarkedJsonToolParser(SectionToolParser):
    """The small JSON families: a marker, then a JSON array of call objects or a single call object.

    Subclasses name the markers (the first that matches is skipped, so list longer ones first) and the
    keys that may hold a call's arguments.
    """

    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        marker = next(m for m in self.markers + self.leading_markers if text.startswith(m, at))
        j = skip_ws(text, at + (0 if marker in ("[", "{") else len(marker)))
        if j >= len(text):
            return []
        if text[j] == "[":
            return calls_in_array(text, j, self.argument_keys)
        if text[j] == "{":
            return [call_from_object(text, j, self.argument_keys)[0]]
        raise ToolSyntaxError(f"expected a JSON array or object of calls after {marker!r}")


class DelimitedJsonToolParser(SectionToolParser):
    """A section of calls each written CALL_BEGIN header HEADER_END {arguments} CALL_END (DeepSeek V3 /
    V3.1, Kimi K2); subclasses say what the header names."""

    call_begin: ClassVar[str]
    header_end: ClassVar[str]
    call_end: ClassVar[str]

    def header_call(self, header: str) -> CallDraft:
        """The call a complete header names; ToolSyntaxError if it names none."""
        name = header.strip()
        if not name:
            raise ToolSyntaxError(f"expected a function name after {self.call_begin}")
        return CallDraft(name)

    def arguments_at(self, text: str, k: int) -> int | None:
        """Where the arguments object opens, from the first non-space after the header; None while unknown."""
        return k

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        calls: list[CallDraft] = []
        j = at + len(next(m for m in self.markers if text.startswith(m, at)))
        while True:
            j = skip_ws(text, j)
            if not text.startswith(self.call_begin, j):
                return calls  # the section's end marker, or it has not arrived yet
            sep = text.find(self.header_end, j)
            if sep < 0:
                return calls + [CallDraft(None)]
            call = self.header_call(text[j + len(self.call_begin):sep])
            calls.append(call)
            k = self.arguments_at(text, skip_ws(text, sep + len(self.header_end)))
            if k is None or k >= len(text):
                return calls
            if text[k] != "{":
                raise ToolSyntaxError(f"expected JSON arguments for {call.name!r}")
            end = value_end(text, k)
            call.arguments, call.complete = text[k:end], end is not None
            if end is None:
                return calls
            j = text.find(self.call_end, end)
            if j < 0:
                return calls
            j += len(self.call_end)
