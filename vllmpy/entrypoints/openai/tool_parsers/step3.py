"""StepFun Step-3: optional content, then

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">
    <steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke><｜tool_call_end｜>

repeated, then <｜tool_calls_end｜> (the ｜ markers are special tokens)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import XmlToolParser


@TOOL_PARSERS.register("step3")
class Step3ToolParser(XmlToolParser):
    keeps_special_tokens = True
    fillers = ("<｜tool_calls_begin｜>",)
    call_open = ("<｜tool_call_begin｜>", "function", "<｜tool_sep｜>", '<steptml:invoke name="')
    name_ends = ('">',)
    param_open, key_end = '<steptml:parameter name="', '">'
    value_ends = ("</steptml:parameter>", '<steptml:parameter name="', "</steptml:invoke>")
    call_close = ("</steptml:invoke>", "<｜tool_call_end｜>")
