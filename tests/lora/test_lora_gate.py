"""The LoRA gate: random PEFT adapters on tiny random models of two families, against transformers + peft in
fp32 (greedy 32 tokens, the gate's strict / near-tie rule); one batch mixing the base model and three
adapters gives each its own tokens; the prefix cache never serves one adapter's KV to another."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.gate import GateResult, compare, reference_greedy
from tests.lora.adapters import SPECS, make_adapter
from tests.tiny_models import make_tiny_checkpoint
from vllmpy import LLM, LoRARequest, SamplingParams

FAMILIES = ["LlamaForCausalLM", "Gemma3ForCausalLM"]
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,"]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@dataclass
class Family:
    base: torch.nn.Module  # transformers
    peft_models: list[torch.nn.Module]
    loras: list[LoRARequest]
    llm: LLM


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, smollm2_tokenizer_dir, tmp_path_factory) -> Family:
    out = tmp_path_factory.mktemp(request.param.lower())
    base = make_tiny_checkpoint(request.param, smollm2_tokenizer_dir, out / "base")
    peft_models, loras = [], []
    for i, spec in enumerate(SPECS):
        peft_models.append(make_adapter(base, out / f"lora{i}", spec, seed=i + 1))
        loras.append(LoRARequest(f"lora{i}", i + 1, str(out / f"lora{i}")))
    llm = LLM(model=str(out / "base"), dtype="float32", enable_lora=True, max_loras=3, num_blocks=96,
              block_size=16, max_model_len=256)
    return Family(base, peft_models, loras, llm)


def _gate(family: Family, reference: torch.nn.Module, lora: LoRARequest | None, label: str) -> list[list[int]]:
    result = GateResult()
    outputs = family.llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
    for output in outputs:
        ref_tokens, ref_logits = reference_greedy(reference, output.prompt_token_ids, MAX_TOKENS)
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"{label} {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    print(f"{label} {result.summary()}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_matches_peft(family):
    with torch.no_grad():
        base_tokens = _gate(family, family.base, None, "base")
        for reference, lora in zip(family.peft_models, family.loras):
            tokens = _gate(family, reference, lora, lora.lora_name)
            assert tokens != base_tokens, f"{lora.lora_name} left the greedy tokens unchanged"


def test_mixed_batch_equals_each_alone(family):
    """Base rows and rows on three adapters in one step each get what they get alone."""
    choices = [None, *family.loras]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = {}
    for lora in choices:
        for prompt, output in zip(PROMPTS, family.llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)):
            alone[prompt, lora] = output.outputs[0].token_ids
    prompts = [p for p in PROMPTS for _ in choices]
    loras = [lora for _ in PROMPTS for lora in choices]
    mixed = family.llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for prompt, lora, output in zip(prompts, loras, mixed):
        assert output.outputs[0].token_ids == alone[prompt, lora], (prompt, lora)


def test_prefix_cache_never_crosses_adapters(family):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, second = family.loras[0], family.loras[1]

    def cached(lora: LoRARequest | None) -> int:
        return family.llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(first) == 0
    assert cached(second) == 0  # same tokens, another adapter: no hit
    assert cached(None) == 0  # nor the base model
    assert cached(second) > 0  # the same adapter again: hit
    assert cached(first) > 0


def test_one_slot_and_one_loaded_adapter_serve_three(family):
    """--max-loras 1 --max-cpu-loras 1: the scheduler runs one adapter at a time, each slot write evicts the
    last one and every adapter is read again from its directory; the tokens are those of the roomy engine."""
    llm = LLM(model=family.llm.config.model.model, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              num_blocks=96, block_size=16, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loras = [lora for lora in family.loras for _ in PROMPTS] + [None, None]
    prompts = PROMPTS * len(family.loras) + PROMPTS
    expected = family.llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.list_loras() == {family.loras[-1].lora_int_id}


def test_an_id_reloaded_from_another_path_serves_the_new_weights(family):
    """Resident slots follow the files: the same id under another path (or after remove_lora) is read again."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(lora: LoRARequest) -> list[int]:
        return family.llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids

    first, second = family.loras[0], family.loras[1]
    assert tokens(LoRARequest("swap", 50, first.lora_path)) == tokens(first)
    assert tokens(LoRARequest("swap", 50, second.lora_path)) == tokens(second)
    assert family.llm.engine.remove_lora(50) and 50 not in family.llm.engine.list_loras()
    assert tokens(LoRARequest("swap", 50, first.lora_path)) == tokens(first)
