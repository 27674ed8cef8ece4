"""DeepSeek V3 / R1-0528: optional content, then
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
repeated, then <｜tool▁calls▁end｜>."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import DelimitedJsonToolParser, skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


@TOOL_PARSERS.register("deepseek_v3")
class DeepSeekV3ToolParser(DelimitedJsonToolParser):
    markers = (CALLS_BEGIN,)
    call_begin, header_end, call_end = CALL_BEGIN, FENCE, CALL_END

    def header_call(self, header: str) -> CallDraft:
        _, sep, name = header.partition(SEP)
        if not sep or not name.strip() or len(name.split()) != 1:
            raise ToolSyntaxError(f"expected TYPE{SEP}NAME before the ```json fence, got {header!r}")
        return CallDraft(name.strip())

    def arguments_at(self, text: str, k: int) -> int | None:
        if "json".startswith(text[k:k + 4]) and k + 4 > len(text):
            return None  # the fence's language tag is still being written
        return skip_ws(text, k + 4) if text.startswith("json", k) else k
