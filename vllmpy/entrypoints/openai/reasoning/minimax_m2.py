"""MiniMax-M2: the template opens `<think>` in the prompt and the model writes only `</think>`:
everything before it is reasoning, as DeepSeek R1's."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("minimax_m2")
class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    pass
