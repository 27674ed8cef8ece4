"""Llama 3.1 / 3.2 JSON calls: the output opens with `<|python_tag|>` (kept only when special tokens are)
or `{`, then `{"name": "f", "parameters": {...}}` objects joined by `;`. Anything else is content."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import call_from_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonToolParser(SectionToolParser):
    markers = (PYTHON_TAG, "{")
    leading_only = True

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        j = at + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, at) else at
        calls = []
        while (j := skip_ws(text, j)) < len(text):
            if text[j] != "{":
                raise ToolSyntaxError("expected a JSON object")
            call, end = call_from_object(text, j, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
            if not text.startswith(";", j):
                break
            j += 1
        return calls
