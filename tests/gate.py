"""The correctness gate: greedy tokens and chosen-token logprobs vs transformers in fp32.

A divergence is accepted only as a near-tie: the oracle's top-2 logit gap at that step is below
NEAR_TIE_GAP. After a near-tie the two continuations differ, so comparison of that prompt stops.
"""
from __future__ import annotations

import hashlib
import math
import weakref
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


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int,
                     **model_inputs) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its raw logits at every generated step [steps, vocab].
    model_inputs: what else the model takes (a VLM's pixel_values and token_type_ids).
    A tiny text-only reference is run once per session (the fp32 and bf16 gates share the run)."""
    key = _oracle_key(model, prompt_ids, max_new_tokens) if not model_inputs else None
    if key in _ORACLE:
        tokens, compact = _ORACLE[key]
        return tokens, compact.expand()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None, **model_inputs)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()
    if key is not None:
        _ORACLE[key] = (tokens, CompactLogits.of(logits))
    return tokens, logits


# Only checkpoints this small are fingerprinted (hashing a real model's weights per prompt would cost more).
_ORACLE_MAX_PARAMS = 20_000_000
# (config, weights digest, prompt ids, steps) -> the oracle's tokens and compact logits, for the session.
_ORACLE: dict[tuple, tuple[list[int], CompactLogits]] = {}


# model -> its fingerprint, taken at its first oracle run (a gate's reference is not edited after that).
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _oracle_key(model, prompt_ids: list[int], max_new_tokens: int) -> tuple | None:
    """The tiny checkpoint's identity (its config and a digest of every weight and buffer), the prompt, the steps."""
    if model not in _FINGERPRINTS:
        tensors = list(model.state_dict().values())
        digest = None
        if sum(t.numel() for t in tensors) <= _ORACLE_MAX_PARAMS:
            hasher = hashlib.blake2b(digest_size=16)
            for t in tensors:
                hasher.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
            digest = (model.config.to_json_string(), hasher.hexdigest())
        _FINGERPRINTS[model] = digest
    digest = _FINGERPRINTS[model]
    return None if digest is None else (*digest, tuple(prompt_ids), max_new_tokens)


@dataclass(frozen=True)
class CompactLogits:
    """A step's top-k logits exactly, and the rest as one value with the rest's exact log-sum-exp, so the
    expanded logits give the same top-k, the same log-softmax on them, and any other token below them.
    Why: full [steps, vocab] logits of ~50 tiny references would hold ~1.5 GB for the whole session."""
    values: torch.Tensor   # [steps, k] float32
    indices: torch.Tensor  # [steps, k]
    rest: torch.Tensor     # [steps] float64: the value every other token gets
    vocab: int

    K = 32

    @classmethod
    def of(cls, logits: torch.Tensor) -> CompactLogits:
        values, indices = logits.topk(cls.K, dim=-1)
        others = logits.double().scatter(-1, indices, float("-inf"))
        rest = torch.logsumexp(others, dim=-1) - math.log(logits.shape[-1] - cls.K)
        return cls(values, indices, rest, logits.shape[-1])

    def expand(self) -> torch.Tensor:
        out = self.rest.float()[:, None].expand(-1, self.vocab).clone()
        return out.scatter_(-1, self.indices, self.values)


def compare(result: GateResult, label: str, ours: list[int], our_logprobs: list[float],
            ref: list[int], ref_logits: torch.Tensor, logprob_tol: float = LOGPROB_TOL) -> None:
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
        if err > logprob_tol:
            result.failures.append(f"{label}: step {step}: logprob {our_logprobs[step]:.5f} vs {float(ref_logprobs[step, b]):.5f}")
            return
    if len(ours) != len(ref):  # a request that failed (or stopped early) must not pass as strict
        result.failures.append(f"{label}: {len(ours)} tokens vs the reference's {len(ref)}")
        return
    result.strict += 1


def gate_llm(llm, reference, prompts: list[str], max_tokens: int, label: str,
             logprob_tol: float = LOGPROB_TOL) -> GateResult:
    """Greedy `max_tokens` on every prompt with vllmpy and with the transformers `reference`, compared."""
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    result = GateResult()
    for output in llm.generate(prompts, params, use_tqdm=False):
        ref_tokens, ref_logits = reference_greedy(reference, output.prompt_token_ids, max_tokens)
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"{label} {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits,
                logprob_tol)
    print(f"{label} {result.summary()}")
    return result



TOP_N = 5  # vLLM's check_logprobs_close as its model tests use it: logprobs=5 on both sides


@dataclass
class CloseResult:
    """Prompts identical to the oracle (strict), diverged within each other's top-N (close, with the step
    of the first divergence), or diverged outside it (failures)."""
    strict: int = 0
    first_divergence: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"close gate: strict={self.strict} top{TOP_N}-close={len(self.first_divergence)} "
                f"first divergence at steps {self.first_divergence} failures={len(self.failures)}")


def check_logprobs_close(result: CloseResult, label: str, ours: list[int], our_top: list[set[int]],
                         ref: list[int], ref_top: list[set[int]]) -> None:
    """vLLM's rule for a lower-precision run: at the first step where the greedy tokens differ, each side's
    token must be among the other's top-N there; the continuations then differ, so comparison stops."""
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens vs the reference's {len(ref)}"
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        if a in ref_top[step] and b in our_top[step]:
            result.first_divergence.append(step)
        else:
            result.failures.append(f"{label}: step {step}: ours {a} (in the reference's top-{TOP_N}: "
                                   f"{a in ref_top[step]}) vs reference {b} (in ours: {b in our_top[step]})")
        return
    result.strict += 1


def gate_llm_close(llm, reference, prompts: list[str], max_tokens: int, label: str,
                   oracle_tokens: int) -> CloseResult:
    """Greedy `max_tokens` with vllmpy (any dtype) and the fp32 `reference`, judged by check_logprobs_close.
    The oracle runs `oracle_tokens` >= max_tokens steps (the fp32 gate's length: that run is shared) and its
    first max_tokens are compared (greedy is causal: the shorter run is that prefix)."""
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_N)
    result = CloseResult()
    for output in llm.generate(prompts, params, use_tqdm=False):
        ref_tokens, ref_logits = reference_greedy(reference, output.prompt_token_ids, oracle_tokens)
        ref_tokens, ref_logits = ref_tokens[:max_tokens], ref_logits[:max_tokens]
        completion = output.outputs[0]
        ref_top = [set(row.tolist()) for row in ref_logits.topk(TOP_N, dim=-1).indices]
        check_logprobs_close(result, f"{label} {output.prompt!r}", completion.token_ids,
                             [set(pos) for pos in completion.logprobs], ref_tokens, ref_top)
    print(f"{label} {result.summary()}")
    return result


def gate_tiny_family(gate_id: str, make_config, description: str, tokenizer_dir: str, tmp_path, gate_report,
                     prompts: list[str] | None = None, check=None, invariance: bool = True, **llm_kwargs) -> None:
    """The whole gate for a family whose tiny config lives with its own test file: a random checkpoint from
    make_config(vocab_size), greedy vs transformers on `prompts` (default: the gate prompts; recorded in the
    gate report), then, unless `invariance` is off, `check(llm)`: by default test_batch_invariance's
    batched / chunked / prefix-cached / preempted / late-arrival checks. llm_kwargs override the LLM's."""
    from tests.models.test_batch_invariance import MAX_MODEL_LEN, _check_invariance
    from tests.models.test_gate_transformers import MAX_TOKENS, PROMPTS
    from tests.tiny_models import make_tiny_checkpoint
    from vllmpy import LLM

    prompts = prompts or PROMPTS
    reference = make_tiny_checkpoint(gate_id, tokenizer_dir, tmp_path, make_config)
    llm = LLM(model=str(tmp_path), **{"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_blocks": 256,
                                      "block_size": 16, **llm_kwargs})
    result = gate_llm(llm, reference, prompts, MAX_TOKENS, gate_id)
    gate_report(gate_id, result, description, len(prompts))
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(prompts)
    if invariance:
        (check or _check_invariance)(llm)
