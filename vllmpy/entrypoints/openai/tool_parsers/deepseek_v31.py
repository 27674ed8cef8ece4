"""DeepSeek V3.1 / V3.2-Exp: DeepSeek V3's markers without the type and the fence:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜> repeated, then
<｜tool▁calls▁end｜>."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, SEP
from vllmpy.entrypoints.openai.tool_parsers.json_text import DelimitedJsonToolParser


@TOOL_PARSERS.register("deepseek_v31")
class DeepSeekV31ToolParser(DelimitedJsonToolParser):
    markers = (CALLS_BEGIN,)
    call_begin, header_end, call_end = CALL_BEGIN, SEP, CALL_END
