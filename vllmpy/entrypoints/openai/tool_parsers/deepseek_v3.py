"""DeepSeek V3 / R1-0528: optional content, then
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
repeated, then <｜tool▁calls▁end｜>."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import skip_ws, value_end

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```json"


@TOOL_PARSERS.register("deepseek_v3")
class DeepSeekV3ToolParser(SectionToolParser):
    markers = (CALLS_BEGIN,)

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        calls: list[CallDraft] = []
        j = at + len(CALLS_BEGIN)
        while True:
            j = skip_ws(text, j)
            if not text.startswith(CALL_BEGIN, j):
                return calls  # the section's end marker, or it has not arrived yet
            sep = text.find(SEP, j)
            line_end = text.find("\n", sep + len(SEP)) if sep >= 0 else -1
            if line_end < 0:
                return calls + [CallDraft(None)]
            call = CallDraft(text[sep + len(SEP):line_end].strip())
            calls.append(call)
            k = skip_ws(text, line_end)
            if FENCE.startswith(text[k:k + len(FENCE)]) and k + len(FENCE) > len(text):
                return calls  # the fence is still being written
            if not text.startswith("```", k):
                raise ToolSyntaxError(f"expected a ```json fence after {call.name!r}")
            k = skip_ws(text, k + (len(FENCE) if text.startswith(FENCE, k) else 3))
            if k >= len(text):
                return calls
            if text[k] != "{":
                raise ToolSyntaxError(f"expected JSON arguments for {call.name!r}")
            end = value_end(text, k)
            call.arguments, call.complete = text[k:end], end is not None
            if end is None:
                return calls
            j = text.find(CALL_END, end)
            if j < 0:
                return calls
            j += len(CALL_END)
