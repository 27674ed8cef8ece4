"""Tensor parallel gate: TP=2 (gloo, one thread per rank) against TP=1 on the same checkpoint, greedy
tokens strict or near-tie by tests/gate.py's rule (TP=1's logits are the oracle), chosen-token logprobs
within its tolerance; a dead worker stops the engine; shutdown leaves no child process."""
from __future__ import annotations

import multiprocessing
import os
import signal

import gguf
import numpy as np
import pytest
import torch

from tests.gate import GateResult, compare

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=128, num_blocks=64, block_size=16)


def _oracle(llm, prompts: list[str] = PROMPTS) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """TP=1's (prompt ids, greedy tokens, [steps, vocab] stand-in logits) for gate.compare: its top-2
    logprobs exactly, and every other token the mean of the remaining mass. That mean is at most the
    second logprob, so the top-2 (the near-tie gap) and the log_softmax of the top tokens are TP=1's own,
    without building the whole vocabulary's logprobs in Python at every step."""
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    vocab = llm.engine.core.vocab_size
    runs = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        steps = torch.empty(len(completion.token_ids), vocab, dtype=torch.float64)
        for step, position in enumerate(completion.logprobs):
            top = torch.tensor([entry.logprob for entry in position.values()], dtype=torch.float64)
            rest = (1.0 - top.exp().sum()).clamp_min(1e-300)
            steps[step] = torch.log(rest / (vocab - len(top)))
            steps[step, torch.tensor(list(position))] = top
        runs.append((output.prompt_token_ids, completion.token_ids, steps))
    return runs


def _gate(llm, oracle, label: str) -> GateResult:
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    result = GateResult()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in oracle], params, use_tqdm=False)
    for output, (_, ref_tokens, ref_logits) in zip(outputs, oracle):
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, label, completion.token_ids, logprobs, ref_tokens, ref_logits)
    print(f"{label} {result.summary()}")
    return result


def _tp_matches_tp1(model: str, label: str) -> object:
    """Gate TP=2 against TP=1 on `model`; return the TP=2 engine's core, shut down, for further checks."""
    from vllmpy import LLM

    oracle = _oracle(LLM(model=model, **ENGINE))
    llm = LLM(model=model, tensor_parallel_size=2, **ENGINE)
    try:
        result = _gate(llm, oracle, label)
        assert not result.failures, "\n".join(result.failures)
        assert result.strict + result.near_tie == len(PROMPTS)
        return llm.engine.core
    finally:
        llm.engine.core.shutdown()
        assert multiprocessing.active_children() == []


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"],
                         ids=["llama-gqa", "qwen3-one-kv-head", "mixtral-moe"])
def test_tp2_matches_tp1(arch, smollm2_tokenizer_dir, tmp_path):
    """GQA 4/2 (KV heads split), MQA (the one KV head replicated on both ranks, tied head), 8 experts."""
    from tests.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    core = _tp_matches_tp1(str(tmp_path), arch)
    attn = core.model.model.layers[0].self_attn
    assert attn.num_heads == 2 and attn.num_kv_heads == 1  # this rank's share


def _packed_llama_gguf(path, smollm2_gguf_path) -> str:
    """A llama GGUF of 32-value block types (every row- and column-split falls on blocks) and SmolLM2's vocabulary."""
    from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS
    from tests.gguf.test_gguf_loader import _encode, _hparams, _weights, _write

    reader = gguf.GGUFReader(smollm2_gguf_path)
    vocab = {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}
    rng = np.random.default_rng(5)
    values = _weights(vocab=len(vocab["tokenizer.ggml.tokens"]), seed=5)
    types = {"token_embd": gguf.GGMLQuantizationType.Q8_0, "attn_q": gguf.GGMLQuantizationType.Q8_0,
             "attn_k": gguf.GGMLQuantizationType.Q8_0, "attn_v": gguf.GGMLQuantizationType.Q5_0,
             "attn_output": gguf.GGMLQuantizationType.Q8_0, "ffn_gate": gguf.GGMLQuantizationType.Q4_0,
             "ffn_up": gguf.GGMLQuantizationType.Q4_0, "ffn_down": gguf.GGMLQuantizationType.Q8_0}
    tensors = {}
    for name, array in values.items():
        qtype = types.get(name.removesuffix(".weight").split(".")[-1], gguf.GGMLQuantizationType.F32)
        tensors[name] = (array * 0.2 if qtype == gguf.GGMLQuantizationType.F32 and array.ndim == 2 else array, qtype)
        if qtype != gguf.GGMLQuantizationType.F32:
            tensors[name] = (_encode(array * 0.2, qtype, rng), qtype)
    return str(_write(path / "packed.gguf", "llama", {**_hparams("llama"), **vocab}, tensors))


def test_packed_gguf_tp2_matches_tp1(smollm2_gguf_path, tmp_path):
    """Packed weights are sharded in their blocks: the driver's shard is still packed, at half the rows / columns."""
    core = _tp_matches_tp1(_packed_llama_gguf(tmp_path, smollm2_gguf_path), "packed gguf llama")
    layer = core.model.model.layers[0]
    assert [segment.shape for segment in layer.self_attn.qkv_proj.segments] == [(48, 64), (16, 64)]  # q+k (Q8_0), v (Q5_0)
    assert layer.self_attn.o_proj.packed.shape == (64, 32)
    assert layer.mlp.down_proj.packed.shape == (64, 64)
    assert core.model.model.embed_tokens.packed.shape == (49152 // 2, 64)


def test_dead_worker_stops_the_engine(tiny_llama_dir):
    """A killed worker fails the next step with an error naming it (no hang), and no child is left."""
    from vllmpy import LLM

    kill_worker_then_steps_fail(LLM(model=tiny_llama_dir, tensor_parallel_size=2, **ENGINE))


def kill_worker_then_steps_fail(llm) -> None:
    """SIGKILL rank 1: every later step raises DistributedEngineError naming it, and no child is left."""
    from vllmpy import SamplingParams
    from vllmpy.distributed import DistributedEngineError

    worker = llm.engine.core.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(DistributedEngineError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(DistributedEngineError, match="stopped"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    assert multiprocessing.active_children() == []
