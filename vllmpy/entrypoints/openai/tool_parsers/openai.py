"""gpt-oss (OpenAI harmony): a call is a message to `functions.NAME`, usually on the commentary channel,
`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>`; the content
is the final channel's text (and commentary preambles), while analysis messages are reasoning, left to
the `openai` reasoning parser. Text outside harmony messages is content, so the parser also reads what
that reasoning parser passes on. The markers are special tokens."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, Extraction, ToolParser
from vllmpy.entrypoints.openai.tool_parsers.harmony import segments

FUNCTIONS = "functions."


@TOOL_PARSERS.register("openai")
class OpenAIToolParser(ToolParser):
    keeps_special_tokens = True

    def extract(self, text: str, final: bool) -> Extraction:
        found = Extraction("")
        for segment in segments(text, final):
            message = segment.message
            if message is None:
                found.content += segment.text
            elif message.recipient is None:
                if message.channel != "analysis":
                    found.content += message.body
            elif message.recipient.startswith(FUNCTIONS):
                found.calls.append(CallDraft(message.recipient[len(FUNCTIONS):], message.body.strip(),
                                             complete=message.closed or final))
        return found
