"""What the offline modes share: an LLM built from the engine flags, its header and its random prompts."""
from __future__ import annotations

import argparse

from vllmpy.entrypoints.bench.header import engine_header
from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids
from vllmpy.entrypoints.engine_args import engine_config_from_args
from vllmpy.entrypoints.llm import LLM
from vllmpy.sampling_params import SamplingParams


class OfflineBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.llm = LLM(engine_config=engine_config_from_args(args))
        core = self.llm.engine.core
        self.header = engine_header(core)
        self._vocab = usable_token_ids(self.llm.get_tokenizer(), core.vocab_size)
        self.seed = 0 if args.seed is None else args.seed  # --seed (an engine flag) also seeds the prompts

    def random_prompts(self, count: int, length: int, seed: int) -> list[dict]:
        return [{"prompt_token_ids": ids} for ids in random_token_prompts(self._vocab, count, length, seed)]

    @staticmethod
    def params(output_len: int) -> SamplingParams:
        """Greedy with a fixed output length, so every engine and every run does the same work."""
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def warm_up(self, seed: int) -> None:
        """One short request first: the first forward pays one-time costs (allocator, kernel selection)."""
        self.llm.generate(self.random_prompts(1, 8, seed), self.params(2), use_tqdm=False)
