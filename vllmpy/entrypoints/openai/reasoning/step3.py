"""StepFun Step-3: the template opens `<think>`; everything before `</think>` is reasoning, as DeepSeek R1's."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("step3")
class Step3ReasoningParser(DeepSeekR1ReasoningParser):
    pass
