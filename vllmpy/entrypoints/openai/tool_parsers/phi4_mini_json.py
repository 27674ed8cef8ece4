"""Phi-4-mini: optional content, then `functools[{"name": "f", "arguments": {...}}, ...]`."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser


@TOOL_PARSERS.register("phi4_mini_json")
class Phi4MiniJsonToolParser(MarkedJsonToolParser):
    markers = ("functools",)
    argument_keys = ("arguments", "parameters")
