"""Tensor-parallel layouts without processes: which architectures shard, the KV-head rule, packed
weights narrowed in their blocks, the refused flags, and a TP=1 engine left untouched."""
from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch

from vllmpy.errors import UnsupportedCheckpointError

# Refused by name at startup, with the reason (their layers have no tensor-parallel layout yet).
REFUSED = {"OPTForCausalLM/post-norm": "project_in", "StableLmForCausalLM": "q/k norms",
           "Olmo2ForCausalLM": "q/k norms", "Olmo3ForCausalLM": "q/k norms", "CohereForCausalLM": "q/k norms"}


@pytest.mark.parametrize("arch", __import__("tests.tiny_models", fromlist=["ARCHITECTURES"]).ARCHITECTURES)
def test_every_tiny_architecture_shards_or_is_refused_by_name(arch):
    from tests.tiny_models import _configs
    from vllmpy.distributed import check_shardable

    config = _configs(512)[arch].to_dict()
    config["architectures"] = [arch.split("/")[0]]
    if arch not in REFUSED:
        check_shardable(config, "generate", 2)
        return
    with pytest.raises(UnsupportedCheckpointError, match=arch.split("/")[0]) as refusal:
        check_shardable(config, "generate", 2)
    assert REFUSED[arch] in str(refusal.value) and "tensor" in str(refusal.value)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_kv_heads_split_or_replicated(ranks):
    """8 query heads, 4 KV heads: split over 2 or 4 ranks; over 8 each KV head serves two ranks (vLLM)."""
    from vllmpy.distributed.parallel_state import TPGroup
    from vllmpy.layers.parallel import _split_heads

    shares = [_split_heads(TPGroup(r, ranks, torch.device("cpu")), 8, 4, "t") for r in range(ranks)]
    assert [s[1] for s in shares] == [r * 8 // ranks for r in range(ranks)]
    assert all(s[0] == 8 // ranks and s[2] == max(1, 4 // ranks) for s in shares)
    # each rank's query heads read the KV head they read in the whole model
    for heads, first, kv_heads, first_kv in shares:
        assert {h // 2 for h in range(first, first + heads)} == set(range(first_kv, first_kv + kv_heads))


def test_indivisible_heads_are_refused():
    from vllmpy.distributed.parallel_state import TPGroup
    from vllmpy.layers.parallel import _split_heads

    with pytest.raises(UnsupportedCheckpointError, match="6 KV heads .* --tensor-parallel-size 4"):
        _split_heads(TPGroup(0, 4, torch.device("cpu")), 12, 6, "t")


def test_packed_columns_narrow_in_blocks_or_decode():
    from vllmpy.layers.parallel import RowSplit
    from vllmpy.layers.quantized import PackedTensor

    values = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    packed = PackedTensor.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                                     int(gguf.GGMLQuantizationType.Q8_0), (4, 128))
    aligned = RowSplit(64, 64, 1, "t")("weight", packed, None)
    assert isinstance(aligned, PackedTensor) and aligned.shape == (4, 64)
    assert torch.equal(aligned.dequantize(), packed.dequantize()[:, 64:])
    unaligned = RowSplit(48, 16, 1, "t")("weight", packed, None)  # inside a 32-value block: decoded
    assert isinstance(unaligned, torch.Tensor) and torch.equal(unaligned, packed.dequantize()[:, 48:64])
    assert not RowSplit(0, 64, 1, "t")("bias", torch.ones(4), None).any()  # rank 1 adds no bias


@pytest.mark.parametrize("flag, value, message", [
    ("pipeline_parallel_size", 0, "--pipeline-parallel-size must be >= 1"),
    ("data_parallel_size", 0, "--data-parallel-size must be >= 1"),
    ("distributed_executor_backend", "threads", "--distributed-executor-backend must be one of mp, ray, uni"),
    ("tensor_parallel_size", 0, "--tensor-parallel-size must be >= 1"),
])
def test_unbuilt_parallel_modes_are_refused_by_name(flag, value, message):
    from vllmpy.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**{flag: value})


def test_tp_with_pp_is_refused_by_name():
    from vllmpy.config import EngineConfig

    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 with --tensor-parallel-size 2: the two are not "
                                         "combined yet"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=2)


def test_flags_bind_and_ray_is_never_imported(monkeypatch):
    import argparse

    monkeypatch.delitem(sys.modules, "ray", raising=False)  # an earlier test may have used the ray executor

    from vllmpy.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "--distributed-executor-backend", "mp"]))
    assert config.parallel.tensor_parallel_size == 2 and config.parallel.distributed_executor_backend == "mp"
    assert "ray" not in sys.modules


def test_tp1_engine_has_no_parallel_hooks(tiny_llama_dir):
    """The default path pays nothing: no executor, no split loaders, no forward hooks."""
    from vllmpy import LLM

    core = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, num_blocks=16).engine.core
    assert core.executor is None and core.batch_queue is None
    assert not any(hasattr(m, "tp_split") or m._forward_hooks for m in core.model.modules())
    assert "compute_logits" not in vars(core.model)


def test_ray_backend_without_ray_names_the_extra(monkeypatch, tiny_llama_dir):
    from vllmpy import LLM

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    with pytest.raises(ValueError, match=r"ray needs the ray package: pip install 'vllmpy\[ray\]'"):
        LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32",
            max_model_len=64, num_blocks=16)
