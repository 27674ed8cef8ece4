"""DeepSeek V3.1+ hybrid thinking: with chat_template_kwargs {"thinking": true} the template opens
`<think>` and the output reads as DeepSeek R1's; otherwise the whole output is content (as vLLM)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningSplit
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("deepseek_v3")
class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    def extract(self, text: str, final: bool) -> ReasoningSplit:
        kwargs = self.chat_template_kwargs
        if not kwargs.get("thinking", kwargs.get("enable_thinking", False)):
            return ReasoningSplit(content=text)
        return super().extract(text, final)
