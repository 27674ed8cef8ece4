"""IBM Granite 3.x: the output opens with `<|tool_call|>` (3.0, a special token) or `<tool_call>` (3.1+),
then a JSON array of {"name": "f", "arguments": {...}}."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import calls_in_array, skip_ws


@TOOL_PARSERS.register("granite")
class GraniteToolParser(SectionToolParser):
    markers = ("<|tool_call|>", "<tool_call>")
    leading_only = True
    keeps_special_tokens = True

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        marker = next(m for m in self.markers if text.startswith(m, at))
        j = skip_ws(text, at + len(marker))
        if j >= len(text):
            return []
        if text[j] != "[":
            raise ToolSyntaxError(f"expected a JSON array after {marker}")
        return calls_in_array(text, j, ("arguments",))
