"""GLM-4.5 / 4.6 (and 4.7, which drops the newline after the name): optional content, then per call

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value whose parameter the request does not declare is read as JSON when it parses, as vLLM does."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import XmlToolParser


@TOOL_PARSERS.register("glm45")
class Glm45ToolParser(XmlToolParser):
    keeps_special_tokens = True  # GLM's tool tags are special tokens (vLLM keeps them too)
    call_open = ("<tool_call>",)
    name_ends = ("\n", "<arg_key>", "</tool_call>")
    param_open, key_end, value_open = "<arg_key>", "</arg_key>", "<arg_value>"
    value_ends = ("</arg_value>",)
    call_close = ("</tool_call>",)
    untyped_json = True
