"""Hermes 2 Pro, Qwen 2.5 and Qwen 3: optional content, then blocks of
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import call_from_object, skip_ws

START = "<tool_call>"


@TOOL_PARSERS.register("hermes")
class HermesToolParser(SectionToolParser):
    markers = (START,)
    keeps_special_tokens = True  # Hermes 2 Pro's <tool_call> is a special token

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        calls = []
        while at >= 0:
            j = skip_ws(text, at + len(START))
            if j >= len(text):
                break
            if text[j] != "{":
                raise ToolSyntaxError(f"expected a JSON object after {START}")
            call, end = call_from_object(text, j, ("arguments",))
            calls.append(call)
            if end is None:
                break
            at = text.find(START, end)  # the closing </tool_call> is optional (Qwen may stop before it)
        return calls
