"""DeepSeek R1: `<think>` (often written by the template, so absent from the output) ... `</think>` content.
Everything before `</think>` is reasoning; an output cut off before it is all reasoning (as vLLM)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser


@REASONING_PARSERS.register("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)

    def implicit_start(self) -> bool:
        return True
