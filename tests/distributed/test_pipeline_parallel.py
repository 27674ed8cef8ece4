"""Pipeline parallel gate: PP=2 (gloo, one thread per stage) against PP=1 on the same checkpoint, greedy
tokens strict or near-tie by tests/gate.py's rule, chosen-token logprobs within its tolerance, with enough
concurrent requests that two micro-batches are in flight at once (the executor counts them); then a
killed stage stops the engine naming its rank, and no child process is left."""
from __future__ import annotations

import multiprocessing

import pytest

from tests.distributed.test_tensor_parallel import ENGINE, _gate, _oracle, kill_worker_then_steps_fail

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"],
                         ids=["llama-untied", "qwen3-tied", "gemma3-sliding-global"])
def test_pp2_matches_pp1(arch, smollm2_tokenizer_dir, tmp_path):
    """Untied head (the last stage loads lm_head), tied (it loads the embedding rows as its head), and the
    default model's family: scaled embeddings (first stage only), sliding and global layers in cache
    groups formed over the whole model, final soft-cap on the last stage."""
    from tests.tiny_models import make_tiny_checkpoint
    from vllmpy import LLM
    from vllmpy.distributed.pipeline import stage_layers

    make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    oracle = _oracle(LLM(model=str(tmp_path), **ENGINE), PROMPTS)
    llm = LLM(model=str(tmp_path), pipeline_parallel_size=2, **ENGINE)
    try:
        result = _gate(llm, oracle, f"{arch} pp=2")
        assert not result.failures, "\n".join(result.failures)
        assert result.strict + result.near_tie == len(PROMPTS)
        core = llm.engine.core
        assert core.executor.max_in_flight == 2  # two micro-batches overlapped
        start, end = stage_layers(core.checkpoint.config["num_hidden_layers"], 0, 2)
        layers = core.model.model.layers  # stage 0's layers, no head; KV pages for those only
        assert len(layers) == end - start and core.model.lm_head is None
        assert len(core.runner.kv_caches) == len(layers)
        kill_worker_then_steps_fail(llm)  # a dead stage stops the engine naming its rank, no hang
    finally:
        llm.engine.core.shutdown()
        assert multiprocessing.active_children() == []


def test_stage_layers_split_as_vllm(monkeypatch):
    """An even split, the remainder one each to the stages before the last (it also holds the head), or
    vLLM's VLLM_PP_LAYER_PARTITION counts."""
    from vllmpy.distributed.pipeline import stage_layers
    from vllmpy.errors import UnsupportedCheckpointError

    assert [stage_layers(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layers(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(UnsupportedCheckpointError, match="at most 2 stages"):
        stage_layers(2, 0, 3)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "7,3")
    assert [stage_layers(10, r, 2) for r in range(2)] == [(0, 7), (7, 10)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "7,4")
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION='7,4': give 2 comma-separated layer counts"):
        stage_layers(10, 0, 2)


def test_unsplit_families_are_refused(smollm2_tokenizer_dir, tmp_path):
    """A family outside the shared dense decoder is refused by name before any worker starts."""
    from tests.tiny_models import make_tiny_checkpoint
    from vllmpy import LLM
    from vllmpy.errors import UnsupportedCheckpointError

    make_tiny_checkpoint("GPT2LMHeadModel", smollm2_tokenizer_dir, tmp_path)
    with pytest.raises(UnsupportedCheckpointError, match="GPT2LMHeadModel.*--pipeline-parallel-size 1"):
        LLM(model=str(tmp_path), pipeline_parallel_size=2, **ENGINE)
    assert multiprocessing.active_children() == []
