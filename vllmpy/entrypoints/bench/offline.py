"""What the offline modes share: an LLM built from the engine flags, its header and its random prompts."""
from __future__ import annotations

import argparse

from vllmpy.entrypoints.bench.header import engine_header
from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids
from vllmpy.entrypoints.engine_args import engine_config_from_args
from vllmpy.entrypoints.llm import LLM
from vllmpy.sampling_params import SamplingParams
from vllmpy.spec_decode.drafter import SpecDecodeStats


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
        drafter = self.llm.engine.core.scheduler.drafter
        if drafter is not None:  # acceptance is reported for the timed requests only
            drafter.stats = SpecDecodeStats(accepted_per_pos=[0] * drafter.config.num_speculative_tokens)

    def spec_figures(self) -> dict[str, float | int | None]:
        """Speculation's acceptance (vLLM's definitions: drafter.py); empty with speculation off."""
        drafter = self.llm.engine.core.scheduler.drafter
        if drafter is None:
            return {}
        stats = drafter.stats
        return {"spec_num_drafts": stats.num_drafts, "spec_num_draft_tokens": stats.num_draft_tokens,
                "spec_num_accepted_tokens": stats.num_accepted_tokens,
                "spec_acceptance_rate": stats.acceptance_rate,
                "spec_mean_acceptance_length": stats.mean_acceptance_length}
