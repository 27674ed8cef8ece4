"""Salesforce xLAM: a JSON array of {"name": "f", "arguments": {...}} that opens the output, or one that
follows content inside a ```json fence, after `[TOOL_CALLS]` or inside <tool_call> ... </tool_call>."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser


@TOOL_PARSERS.register("xlam")
class XLAMToolParser(MarkedJsonToolParser):
    markers = ("```json", "```", "[TOOL_CALLS]", "<tool_call>")
    leading_markers = ("[",)
