"""gpt-oss (OpenAI harmony): the analysis channel is reasoning, the final channel (and commentary
preambles) content. Messages to a recipient (tool calls) pass on as written, for the `openai` tool
parser. Registered as vLLM's `openai_gptoss` and as `openai`."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningSplit
from vllmpy.entrypoints.openai.tool_parsers.harmony import segments


@REASONING_PARSERS.register("openai")
@REASONING_PARSERS.register("openai_gptoss")
class OpenAIReasoningParser(ReasoningParser):
    start_markers = end_markers = ()
    keeps_special_tokens = True

    def extract(self, text: str, final: bool) -> ReasoningSplit:
        split, analysis = ReasoningSplit(), []
        for segment in segments(text, final):
            message = segment.message
            if message is None:
                split.content += segment.text
            elif message.recipient is not None:
                split.content += message.raw
            elif message.channel == "analysis":
                analysis.append(message.body)
            else:
                split.content += message.body
        split.reasoning = "\n".join(analysis)
        return split
