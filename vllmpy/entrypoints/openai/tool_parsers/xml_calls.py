"""Calls written as XML-like tags with bare-text parameter values (Qwen3-Coder, Seed-OSS, GLM-4.5,
MiniMax-M2, Step-3): one scanner, each family names its tags.

Values are text, typed by the parameter's JSON-schema type in the request's tools, as vLLM does: a
string stays as written, "3" becomes 3 for an integer, JSON (or a Python literal) for objects and arrays.
The arguments are a JSON object built one parameter at a time: "{" once the function is named, each
`"key": value` once its value has ended, "}" with the function's closing tag, so the text streamed is
always a prefix of the final arguments.
"""
from __future__ import annotations

import ast
import json
import math
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import skip_ws


class XmlToolParser(SectionToolParser):
    fillers: ClassVar[tuple[str, ...]] = ()  # section tags that may stand before and between calls
    call_open: ClassVar[tuple[str, ...]]  # the tags before the function name (whitespace between)
    name_ends: ClassVar[tuple[str, ...]]  # the first is the name's own closing, consumed; others stay
    param_open: ClassVar[str]
    key_end: ClassVar[str]
    value_open: ClassVar[str] = ""  # GLM writes the value in its own tag after the key's
    value_ends: ClassVar[tuple[str, ...]]  # the first closes the value; the others end one left open
    call_close: ClassVar[tuple[str, ...]]  # the first completes the call; the others may follow it
    untyped_json: ClassVar[bool] = False  # a parameter the request does not declare: JSON if it parses

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "call_open" in cls.__dict__ or "fillers" in cls.__dict__:
            cls.markers = cls.fillers[:1] + cls.call_open[:1]  # the opening tags

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        calls: list[CallDraft] = []
        j = at
        while True:
            j = self._skip_fillers(text, j)
            k = _after_tags(text, j, self.call_open)
            if k is None or k < 0:
                return calls  # the section ends here, or the next call's tags are still being written
            end, tag = _earliest(text, k, self.name_ends)
            if end is None:
                return calls + [CallDraft(None)]
            call = CallDraft(text[k:end].strip(), "{")
            if not call.name:
                raise ToolSyntaxError(f"expected a function name after {self.call_open[-1]!r}")
            calls.append(call)
            j = self._read_parameters(text, end + len(tag) * (tag == self.name_ends[0]), call)
            if j is None:
                return calls

    def _skip_fillers(self, text: str, j: int) -> int:
        while True:
            j = skip_ws(text, j)
            filler = next((f for f in self.fillers if text.startswith(f, j)), None)
            if filler is None:
                return j
            j += len(filler)

    def _read_parameters(self, text: str, p: int, call: CallDraft) -> int | None:
        """Fill `call` from the parameters at text[p]; where the text goes on once it is closed, else None."""
        parts: list[str] = []
        while True:
            p = skip_ws(text, p)
            if text.startswith(self.call_close[0], p):
                call.arguments, call.complete = "{" + ", ".join(parts) + "}", True
                end = _after_tags(text, p + len(self.call_close[0]), self.call_close[1:], optional=True)
                return None if end < 0 else end
            if not text.startswith(self.param_open, p):
                if any(tag.startswith(text[p:]) for tag in (self.call_close[0], self.param_open)):
                    if not parts:
                        call.name = None  # not a call until a tag after the name says so
                    return None  # a tag still being written
                raise ToolSyntaxError(f"unexpected {text[p:p + 20]!r} in the call of {call.name!r}")
            q = p + len(self.param_open)
            key_end = text.find(self.key_end, q)
            if key_end < 0:
                return None
            key = text[q:key_end].strip()
            r = key_end + len(self.key_end)
            if self.value_open:
                r = skip_ws(text, r)
                if not text.startswith(self.value_open, r):
                    if self.value_open.startswith(text[r:]):
                        return None
                    raise ToolSyntaxError(f"expected {self.value_open} after the key {key!r}")
                r += len(self.value_open)
            end, tag = _earliest(text, r, self.value_ends)
            if end is None:
                return None
            value = self.typed_value(text[r:end], self.parameter_schema(call.name, key))
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
            call.arguments = "{" + ", ".join(parts)
            p = end + len(tag) * (tag == self.value_ends[0])

    def typed_value(self, raw: str, schema: dict[str, Any] | None) -> str:
        """A parameter's text as JSON: typed by its declared schema type, kept as a string when that fails."""
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        kinds = _schema_types(schema) if schema is not None else [None] if self.untyped_json else []
        for kind in kinds:  # ["integer", "null"]: the first type the text reads as
            if kind == "string":
                break
            typed = _convert(raw.strip(), kind)
            if typed is not None:
                return typed
        return json.dumps(raw, ensure_ascii=False)


def _schema_types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type", "object" if "properties" in schema else "any")
    return [str(k) for k in kind] if isinstance(kind, list) else [str(kind)]


def _convert(raw: str, kind: str | None) -> str | None:
    """`raw` as JSON text of type `kind` (None: any JSON value), or None when it is not one."""
    if kind in ("integer", "number"):
        try:
            number: int | float = int(raw)
        except ValueError:
            try:
                number = float(raw)
            except ValueError:
                return None
            if not math.isfinite(number) or kind == "integer" and not number.is_integer():
                return None
        return json.dumps(int(number) if kind == "integer" else number)
    if kind == "boolean":
        return raw.lower() if raw.lower() in ("true", "false") else None
    if kind == "null":
        return "null" if raw.lower() in ("null", "none") else None
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    if kind is None:
        return None
    try:  # objects and arrays written as Python literals (single quotes, True/None)
        return json.dumps(ast.literal_eval(raw), ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def _earliest(text: str, start: int, tags: tuple[str, ...]) -> tuple[int | None, str]:
    """The first complete occurrence of any of `tags` at or after `start`: (index, tag), or (None, "")."""
    found = [(i, tag) for tag in tags if (i := text.find(tag, start)) >= 0]
    return min(found) if found else (None, "")


def _after_tags(text: str, j: int, tags: tuple[str, ...], optional: bool = False) -> int | None:
    """Past `tags` written in order from text[j] (whitespace between); -1 while the text ends inside them,
    None when the text says something else (with optional=True, missing tags are skipped instead)."""
    for tag in tags:
        k = skip_ws(text, j) if tag != tags[0] or optional else j
        if text.startswith(tag, k):
            j = k + len(tag)
        elif tag.startswith(text[k:]):
            return -1
        elif not optional:
            return None
    return j
