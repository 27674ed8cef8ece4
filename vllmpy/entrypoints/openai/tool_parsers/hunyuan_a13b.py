"""Tencent Hunyuan-A13B: the answer holds `<tool_calls>[{"name": "f", "arguments": {...}}]</tool_calls>`
after optional content; the same section as Jamba's, so the same reader."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.jamba import JambaToolParser


@TOOL_PARSERS.register("hunyuan_a13b")
class HunyuanA13BToolParser(JambaToolParser):
    keeps_special_tokens = False  # Hunyuan's <tool_calls> is plain text
