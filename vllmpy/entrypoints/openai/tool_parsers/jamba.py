"""AI21 Jamba 1.5 / 1.6: optional content, then `<tool_calls>` (a special token) and a JSON array of
{"name": "f", "arguments": {...}}, closed by `</tool_calls>`."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser


@TOOL_PARSERS.register("jamba")
class JambaToolParser(MarkedJsonToolParser):
    markers = ("<tool_calls>",)
    keeps_special_tokens = True
