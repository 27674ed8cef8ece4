"""Qwen 3: `<think>` ... `</think>` content, like DeepSeek R1, except that with enable_thinking=false
(--no-enable-thinking or chat_template_kwargs) the template closes an empty think block in the prompt,
so the output is content unless it opens `<think>` itself."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("qwen3")
class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    def implicit_start(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
