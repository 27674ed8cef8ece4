"""ByteDance Seed-OSS: Qwen3-Coder's function and parameter tags inside <seed:tool_call> ... </seed:tool_call>:

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>"""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


@TOOL_PARSERS.register("seed_oss")
class SeedOssToolParser(Qwen3CoderToolParser):
    fillers = ("<seed:tool_call>", "</seed:tool_call>")
    call_close = ("</function>", "</seed:tool_call>")
