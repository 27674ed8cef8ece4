"""The correctness gate: greedy tokens and chosen-token logprobs vs transformers in fp32.

A divergence is accepted only as a near-tie: the oracle's top-2 logit gap at that step is below
NEAR_TIE_GAP. After a near-tie the two continuations differ, so comparison of that prompt stops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEAR_TIE_GAP = 1e-4
LOGPROB_TOL = 1e-3


@dataclass
class GateResult:
    strict: int = 0
    near_tie: int = 0
    failures: list[str] = field(default_factory=list)
    max_logprob_err: float = 0.0

    def summary(self) -> str:
        return (f"gate: strict={self.strict} near_tie={self.near_tie} failures={len(self.failures)} "
                f"max_logprob_err={self.max_logprob_err:.2e}")


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its raw logits at every generated step [steps, vocab]."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


def compare(result: GateResult, label: str, ours: list[int], our_logprobs: list[float],
            ref: list[int], ref_logits: torch.Tensor) -> None:
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            if gap < NEAR_TIE_GAP and float(ref_logits[step, a]) >= float(top2[1]) - 1e-6:
                result.near_tie += 1
            else:
                result.failures.append(f"{label}: step {step}: ours {a} vs reference {b} (top-2 gap {gap:.2e})")
            return
        err = abs(our_logprobs[step] - float(ref_logprobs[step, b]))
        result.max_logprob_err = max(result.max_logprob_err, err)
        if err > LOGPROB_TOL:
            result.failures.append(f"{label}: step {step}: logprob {our_logprobs[step]:.5f} vs {float(ref_logprobs[step, b]):.5f}")
            return
    result.strict += 1


def gate_llm(llm, reference, prompts: list[str], max_tokens: int, label: str) -> GateResult:
    """Greedy `max_tokens` on every prompt with vllmpy and with the transformers `reference`, compared."""
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    result = GateResult()
    for output in llm.generate(prompts, params, use_tqdm=False):
        ref_tokens, ref_logits = reference_greedy(reference, output.prompt_token_ids, max_tokens)
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"{label} {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    print(f"{label} {result.summary()}")
    return result
