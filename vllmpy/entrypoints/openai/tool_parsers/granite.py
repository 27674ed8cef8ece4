"""IBM Granite 3.x: the output opens with `<|tool_call|>` (3.0, a special token) or `<tool_call>` (3.1+),
then a JSON array of {"name": "f", "arguments": {...}}."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser


@TOOL_PARSERS.register("granite")
class GraniteToolParser(MarkedJsonToolParser):
    markers = ("<|tool_call|>", "<tool_call>")
    leading_only = True
    keeps_special_tokens = True
