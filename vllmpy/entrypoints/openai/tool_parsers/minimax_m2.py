"""MiniMax-M2: optional content, then one or more invokes inside <minimax:tool_call> ... </minimax:tool_call>:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>"""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import XmlToolParser


@TOOL_PARSERS.register("minimax_m2")
class MiniMaxM2ToolParser(XmlToolParser):
    fillers = ("<minimax:tool_call>", "</minimax:tool_call>")
    call_open = ('<invoke name="',)
    name_ends = ('">',)
    param_open, key_end = '<parameter name="', '">'
    value_ends = ("</parameter>", '<parameter name="', "</invoke>")
    call_close = ("</invoke>",)
