"""Constrained decoding end to end: every constraint kind holds on sampled output, on a random-weight tiny
Llama and on the real SmolLM2 GGUF; mixed batches, preemption, refusals, and the bitmask itself."""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema
import llguidance
import pytest
import torch

from vllmpy import LLM, SamplingParams
from vllmpy.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from vllmpy.structured_output.bitmask import allocate_bitmask, apply_bitmask
from vllmpy.structured_output.grammar import grammar_text
from vllmpy.tokenizer import Tokenizer

SAMPLES = 20
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-z]{2,8}-[0-9]{2,4}"
CHOICES = ["red", "green", "blue"]
# GBNF as llama.cpp writes it: comments, alternation, classes, bounded repetition, optional parts.
GBNF = r'''# a short list of tagged numbers
root ::= "[" item ("," ws item){0,2} "]"
item ::= tag ":" num
tag  ::= [a-z]{1,4} | "x-" [A-Z]
num  ::= "-"? [0-9]{1,3}
ws   ::= " "?
'''


@dataclass
class Case:
    params: StructuredOutputsParams
    smol_prompt: str  # few-shot, so a 135M model at temperature 1 finishes well inside max_tokens


CASES = {
    "json": Case(StructuredOutputsParams(json=SCHEMA),
                 'Person records:\n{"name": "Ann", "age": 31}\n{"name": "Bob", "age": 45}\n'),
    "regex": Case(StructuredOutputsParams(regex=REGEX), "Codes:\nabc-123\nxyz-4567\n"),
    "choice": Case(StructuredOutputsParams(choice=CHOICES), "Primary colors: red, green, blue.\nMy favorite:"),
    "grammar": Case(StructuredOutputsParams(grammar=GBNF), "[ab:12, c:-3]\n[x-Q:7]\n"),
    "json_object": Case(StructuredOutputsParams(json_object=True), '{"a": 1}\n{"b": 2}\n{"c": 3}\n'),
}


@functools.cache
def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer.backend.to_str())


def _gbnf_accepts(llm: LLM, text: str) -> bool:
    """The grammar engine's own matcher, fed the text freshly tokenized, must end in an accepting state."""
    tokenizer = llm.get_tokenizer()
    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), llguidance.grammar_from("grammar", GBNF), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


CHECKS: dict[str, Callable[[LLM, str], object]] = {
    "json": lambda llm, text: jsonschema.validate(json.loads(text), SCHEMA) is None,
    "regex": lambda llm, text: re.fullmatch(REGEX, text),
    "choice": lambda llm, text: text in CHOICES,
    "grammar": _gbnf_accepts,
    "json_object": lambda llm, text: isinstance(json.loads(text), dict),
}


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, num_blocks=512, max_num_seqs=128)


@pytest.fixture(scope="module")
def smol_llm(smollm2_gguf_path) -> LLM:
    return LLM(model=smollm2_gguf_path, num_blocks=512, max_num_seqs=128)


def _tiny_params(quote_id: int, kind: str, seed: int) -> SamplingParams:
    """A random-weight model has no reason to ever close a JSON string or stop padding with whitespace, so
    JSON kinds drop free whitespace and any-JSON also gets a bias toward the quote token: only termination
    within max_tokens depends on that; validity is the grammar's alone (the bias cannot re-allow a token)."""
    params = CASES[kind].params
    bias = None
    if kind in ("json", "json_object"):
        params = StructuredOutputsParams(**{**vars(params), "disable_any_whitespace": True})
    if kind == "json_object":
        bias = {quote_id: 15.0}
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=params, logit_bias=bias)


def _generate_all_kinds(llm: LLM, make_params: Callable[[str, int], SamplingParams],
                        prompt: Callable[[str], str]) -> dict[str, list]:
    """All kinds × SAMPLES seeds in one batched generate call (one pass of steps, not five)."""
    prompts, params = [], []
    for kind in CASES:
        for seed in range(SAMPLES):
            prompts.append(prompt(kind))
            params.append(make_params(kind, seed))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {kind: outs[i * SAMPLES:(i + 1) * SAMPLES] for i, kind in enumerate(CASES)}


@pytest.fixture(scope="module")
def tiny_outputs(tiny_llm) -> dict[str, list]:
    [quote_id] = tiny_llm.get_tokenizer().encode('"', add_special_tokens=False)
    return _generate_all_kinds(tiny_llm, functools.partial(_tiny_params, quote_id), lambda kind: "Hello")


@pytest.fixture(scope="module")
def smol_outputs(smol_llm) -> dict[str, list]:
    return _generate_all_kinds(
        smol_llm,
        lambda kind, seed: SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                                          structured_outputs=CASES[kind].params),
        lambda kind: CASES[kind].smol_prompt)


def _check_outputs(llm: LLM, kind: str, outputs: list, params: StructuredOutputsParams | None = None) -> None:
    """Every finished sample satisfies the constraint. A 135M model at temperature 1 may also count on past
    max_tokens ('[4, 5, 6, ...'): at most one sample may, and its tokens must still be a prefix the
    constraint's own matcher accepts."""
    assert len(outputs) == SAMPLES
    truncated = [out.outputs[0] for out in outputs if out.outputs[0].finish_reason == "length"]
    assert len(truncated) <= 1, (kind, [c.text for c in truncated])
    for completion in truncated:
        matcher = llguidance.LLMatcher(_ll_tokenizer(llm.get_tokenizer()),
                                       grammar_text(params or CASES[kind].params), log_level=0)
        assert matcher.consume_tokens(list(completion.token_ids)) and not matcher.is_stopped(), (kind, completion.text)
    for out in outputs:
        completion = out.outputs[0]
        if completion.finish_reason == "length":
            continue
        assert completion.finish_reason == "stop", (kind, completion.text)
        assert CHECKS[kind](llm, completion.text), (kind, completion.text)


@pytest.mark.parametrize("kind", list(CASES))
def test_tiny_model_samples_satisfy_constraint(tiny_llm, tiny_outputs, kind):
    _check_outputs(tiny_llm, kind, tiny_outputs[kind])


@pytest.mark.parametrize("kind", list(CASES))
def test_smollm2_samples_satisfy_constraint(smol_llm, smol_outputs, kind):
    _check_outputs(smol_llm, kind, smol_outputs[kind])


def test_constrained_and_free_requests_share_a_batch(smol_llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompt = "The capital of France is"
    alone = smol_llm.generate(prompt, free, use_tqdm=False)[0].outputs[0]
    mixed = smol_llm.generate(
        [CASES["json"].smol_prompt, prompt, CASES["choice"].smol_prompt],
        [SamplingParams(temperature=1.0, seed=1, max_tokens=64, structured_outputs=CASES["json"].params), free,
         SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=CASES["choice"].params, logprobs=1)],
        use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    assert CHECKS["json"](smol_llm, mixed[0].outputs[0].text)
    choice = mixed[2].outputs[0]
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    # Logprobs stay raw: the masked request reports the model's own distribution at its first position.
    # (Masked-and-renormalised would move it by >0.1; the 5e-3 allows for the lone prompt's prefill, 4-32 rows,
    # taking the packed small-batch kernel, whose int16 activation blocks round unlike the batch's tiled path.)
    raw = smol_llm.generate(CASES["choice"].smol_prompt, free, use_tqdm=False)[0].outputs[0].logprobs[0]
    top_id, top = next((t, lp) for t, lp in raw.items() if lp.rank == 1)
    first = choice.logprobs[0]
    for token_id, lp in first.items():
        if lp.rank == 1:
            assert token_id == top_id and lp.logprob == pytest.approx(top.logprob, abs=5e-3)


def test_preempted_requests_resume_their_grammar(tiny_llama_dir):
    """A KV pool too small for the batch preempts and recomputes; a resumed request's matcher is rebuilt
    from its output so far, so greedy outputs match an unpressured run token for token."""
    params = [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{60,90}")) for _ in range(6)]  # SmolLM2 digits are one token each
    prompts = [f"Story {i}:" for i in range(6)]
    roomy = LLM(model=tiny_llama_dir, num_blocks=128, block_size=16, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=tiny_llama_dir, num_blocks=12, block_size=16, max_model_len=128)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out in outs:
        assert re.fullmatch(r"[0-9]{60,90}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_grammar_completion_stops_even_with_ignore_eos_and_min_tokens(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=50, min_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = tiny_llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.stop_reason is None


@pytest.mark.parametrize("params, named", [
    (StructuredOutputsParams(json={"type": "foo"}), "structured_outputs.json: invalid JSON schema: Invalid type"),
    (StructuredOutputsParams(json='{"type": "object",'), "structured_outputs.json: the schema is not valid JSON"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex: invalid regex"),
    (StructuredOutputsParams(regex=r"(?=a)a"), "structured_outputs.regex: invalid regex"),
    (StructuredOutputsParams(grammar="root ::= undefined-rule"), "structured_outputs.grammar: invalid grammar"),
    (StructuredOutputsParams(grammar='root ::= "unclosed'), "structured_outputs.grammar: invalid grammar"),
])
def test_invalid_constraints_are_refused_before_queueing(tiny_llm, params, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        tiny_llm.generate("Hello", SamplingParams(structured_outputs=params), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_params_shape_is_checked_at_construction():
    with pytest.raises(ValueError, match="none is set"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    legacy = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    assert legacy.structured_outputs == StructuredOutputsParams(regex="a+") and legacy.guided_decoding is None
    assert legacy.clone(n=2).structured_outputs == legacy.structured_outputs


def test_equal_specs_compile_once(tiny_llm):
    manager = tiny_llm.engine.core.runner.structured_output
    manager.validate(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    before = len(manager._compiled)
    manager.validate(StructuredOutputsParams(json={"required": ["a"], "type": "object"}))  # same schema
    assert len(manager._compiled) == before


@pytest.mark.parametrize("rows", [None, [1, 3]])
def test_apply_bitmask_matches_bit_by_bit(rows):
    vocab = 75  # not a multiple of 32: the last word is partial
    generator = torch.Generator().manual_seed(0)
    picked = rows or list(range(4))
    bitmask = allocate_bitmask(len(picked), vocab)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, dtype=torch.int32, generator=generator))
    logits = torch.randn(4, vocab, generator=generator)
    expected = logits.clone()
    for j, i in enumerate(picked):
        for t in range(vocab):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                expected[i, t] = float("-inf")
    index = None if rows is None else torch.tensor(rows)
    assert torch.equal(apply_bitmask(logits, index, bitmask), expected)
