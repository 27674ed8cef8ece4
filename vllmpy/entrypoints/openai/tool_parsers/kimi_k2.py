"""Moonshot Kimi K2: optional content, then
<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>
repeated, then <|tool_calls_section_end|> (all special tokens). The model writes the call id
(`functions.NAME:IDX`) itself, and the template sends it back with the tool result, so it is kept."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import DelimitedJsonToolParser


@TOOL_PARSERS.register("kimi_k2")
class KimiK2ToolParser(DelimitedJsonToolParser):
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # both spellings occur
    call_begin, header_end, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    keeps_special_tokens = True

    def header_call(self, header: str) -> CallDraft:
        call_id = header.strip()
        name = call_id.split(":")[0].split(".")[-1]  # functions.get_weather:0 -> get_weather
        if not name:
            raise ToolSyntaxError(f"expected functions.NAME:INDEX after {self.call_begin}, got {call_id!r}")
        return CallDraft(name, id=call_id)
