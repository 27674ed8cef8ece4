"""The sparse MoE layer against a per-token reference, and the three spellings of expert weights
(per-expert, transformers' fused 3D, llama.cpp's stacked per projection) loading alike."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import vllmpy.layers.moe as moe_module
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.moe import SparseMoE
from vllmpy.models.llama import GatedMLP


def _per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    probs = torch.softmax(F.linear(x, moe.gate.weight), dim=-1)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(moe.gate.top_k)
        if moe.gate.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            gate, up = F.linear(x[t], moe.experts.gate_up_proj.weight[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, moe.experts.down_proj.weight[e])
        out[t] += torch.sigmoid(F.linear(x[t], moe.shared_expert_gate.weight))[0] * moe.shared_expert(x[t])
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-matmul", "per-expert-loop"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_moe_matches_per_token_loop(renormalize, grouped, monkeypatch):
    monkeypatch.setattr(moe_module, "_CPU_GROUPED_ROWS_PER_EXPERT", 1 << 20 if grouped else 0)
    torch.manual_seed(0)
    moe = SparseMoE(16, 8, num_experts=6, top_k=2, act="silu", renormalize=renormalize,
                    shared_expert=GatedMLP(16, 12, "silu"))
    for p in moe.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(24, 16)
    used = moe.gate(x).topk(2, dim=-1).indices.unique()
    assert len(used) == 6, "every expert should be routed to"
    assert torch.allclose(moe(x), _per_token_reference(moe, x), atol=1e-5)


def test_top_k_above_expert_count_is_refused():
    with pytest.raises(UnsupportedCheckpointError, match="num_experts_per_tok=5"):
        SparseMoE(16, 8, num_experts=4, top_k=5, act="silu", renormalize=True)


def _load(config: dict, weights: dict[str, torch.Tensor]):
    from vllmpy.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(config)(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model.load_weights(weights.items())
    return model


def test_fused_per_expert_and_stacked_expert_tensors_load_alike(tmp_path):
    """Per-expert keys (what transformers 5 writes), its in-memory fused [E, 2I, H] keys, and llama.cpp's
    [E, I, H] stack per projection all fill the same stacked parameters, equal to transformers' own."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=24)
    config.architectures = ["Qwen2MoeForCausalLM"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    per_expert = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in per_expert
    fused = hf.state_dict()
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    stacked = {k: v for k, v in fused.items() if ".experts." not in k}
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts"
        gate, up = fused[f"{prefix}.gate_up_proj"].chunk(2, dim=1)
        stacked.update({f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up,
                        f"{prefix}.down_proj.weight": fused[f"{prefix}.down_proj"]})

    models = [_load(config.to_dict(), weights) for weights in (per_expert, fused, stacked)]
    for i in range(2):
        ours = [m.model.layers[i].mlp.experts for m in models]
        for experts in ours:
            assert torch.equal(experts.gate_up_proj.weight, fused[f"model.layers.{i}.mlp.experts.gate_up_proj"])
            assert torch.equal(experts.down_proj.weight, fused[f"model.layers.{i}.mlp.experts.down_proj"])


def test_missing_expert_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    config.architectures = ["MixtralForCausalLM"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(UnsupportedCheckpointError, match=r"experts.gate_up_proj.weight \(shard \(2, 1\)\)"):
        _load(config.to_dict(), weights)


def test_qwen3_moe_slides_only_with_use_sliding_window():
    from vllmpy.models.qwen3_moe import Qwen3MoeForCausalLM

    config = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "sliding_window": 8}
    for enabled, window in ((False, None), (True, 8)):
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM({**config, "use_sliding_window": enabled})
        assert [layer.self_attn.spec.sliding_window for layer in model.model.layers] == [window, window]


def test_gguf_expert_stacks_stay_packed_and_match_dequantized(smollm2_gguf_path, tmp_path, monkeypatch):
    """A qwen3moe GGUF whose expert stacks are Q8_0 (as llama.cpp writes them): each expert computes on
    its slice of the file's blocks (no dense expert weights at all), with the greedy tokens of the same
    file dequantized at load (VLLMPY_GGUF_KEEP_QUANT=0)."""
    import gguf

    from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS, _tiny
    from tests.models.test_batch_invariance import _agree, _outputs
    from vllmpy import LLM
    from vllmpy.layers.moe import ExpertLinear

    reader = gguf.GGUFReader(smollm2_gguf_path)
    vocab = {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}
    _, path = _tiny("qwen3moe", vocab, tmp_path, expert_type=gguf.GGMLQuantizationType.Q8_0)
    packed = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    stacks = [m for m in packed.engine.core.runner.model.modules() if isinstance(m, ExpertLinear)]
    assert stacks and all(m.packed is not None and m.weight.numel() == 0 for m in stacks)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    kept = _outputs(packed, prompts)
    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")
    dense = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    assert all(m.packed is None for m in dense.engine.core.runner.model.modules() if isinstance(m, ExpertLinear))
    _agree(_outputs(dense, prompts), kept, "packed experts vs dequantized")
