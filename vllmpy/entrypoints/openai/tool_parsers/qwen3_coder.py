"""Qwen3-Coder (and Qwen3-Next / Qwen3.5 templates that copy it): optional content, then per call

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

with values as bare text (one newline around each is the template's, not the value's)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import XmlToolParser


@TOOL_PARSERS.register("qwen3_coder")
class Qwen3CoderToolParser(XmlToolParser):
    fillers = ("<tool_call>", "</tool_call>")
    call_open = ("<function=",)
    name_ends = (">",)
    param_open, key_end = "<parameter=", ">"
    value_ends = ("</parameter>", "<parameter=", "</function>")
    call_close = ("</function>", "</tool_call>")
