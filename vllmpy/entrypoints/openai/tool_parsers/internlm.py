"""InternLM 2 / 2.5: optional content, then `<|action_start|><|plugin|>` (special tokens) and one call
object {"name": "f", "parameters": {...}}, closed by `<|action_end|>`."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser


@TOOL_PARSERS.register("internlm")
class InternLM2ToolParser(MarkedJsonToolParser):
    markers = ("<|action_start|><|plugin|>",)
    argument_keys = ("parameters", "arguments")
    keeps_special_tokens = True
