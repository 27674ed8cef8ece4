"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls with keyword literals,
`[get_weather(city="Paris", days=2), get_time()]`, optionally inside <|python_start|> ... <|python_end|>.

A call's arguments go out whole once its closing parenthesis arrives (they are re-serialized as JSON,
so no earlier prefix is certain).
"""
from __future__ import annotations

import ast
import json
import re

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import balanced_end, next_item, skip_ws

PYTHON_START = "<|python_start|>"
_NAME = re.compile(r"[A-Za-z_]\w*")
_PY_STRING = re.compile(r"""'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*\"""", re.DOTALL)
_PY_STRUCTURAL = re.compile(r"""['"()\[\]{}]""")


@TOOL_PARSERS.register("pythonic")
class PythonicToolParser(SectionToolParser):
    markers = ("[", PYTHON_START)
    leading_only = True

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        if text.startswith(PYTHON_START, at):
            at = skip_ws(text, at + len(PYTHON_START))
            if at >= len(text):
                return []
            if text[at] != "[":
                raise ToolSyntaxError(f"expected a list of calls after {PYTHON_START}")
        calls: list[CallDraft] = []
        j = skip_ws(text, at + 1)
        while j < len(text) and text[j] != "]":
            name = _NAME.match(text, j)
            if name is None:
                raise ToolSyntaxError(f"expected a function name at {text[j:j + 10]!r}")
            k = skip_ws(text, name.end())
            if k >= len(text):
                return calls + [CallDraft(None)]
            if text[k] != "(":
                raise ToolSyntaxError(f"expected '(' after {name.group()!r}")
            end = balanced_end(text, k, _PY_STRUCTURAL, _PY_STRING, "([{")
            if end is None:
                return calls + [CallDraft(name.group())]
            calls.append(CallDraft(name.group(), _arguments(text[j:end]), complete=True))
            j = next_item(text, end)
        return calls


def _arguments(call_text: str) -> str:
    """`f(a=1, b="x")` → '{"a": 1, "b": "x"}': keyword arguments whose values are Python literals."""
    try:
        call = ast.parse(call_text, mode="eval").body  # `name(...)` by construction, so an ast.Call
        if call.args or any(kw.arg is None for kw in call.keywords):
            raise ValueError("only keyword arguments are allowed")
        return json.dumps({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError) as exc:  # TypeError: an unhashable key, or a set
        raise ToolSyntaxError(f"cannot read the call {call_text[:40]!r}: {exc}") from None
