"""ByteDance Seed-OSS: `<seed:think>` ... `</seed:think>` content; like DeepSeek R1, an output without
the opening tag is reasoning up to the closing one."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("seed_oss")
class SeedOssReasoningParser(DeepSeekR1ReasoningParser):
    start_markers = ("<seed:think>",)
    end_markers = ("</seed:think>",)
