"""Gate for the Mamba2 families (Mamba2, Granite 4.0-H, Bamba): each on a tiny random config with its real
layer pattern, greedy 32 tokens vs transformers fp32 (strict or near-tie, logprobs within 1e-3); on
Granite (the mixer kind's one run) batched, chunked-prefill (the state carried across steps) and
preempted runs equal to the prompts run alone. Chunk sizes of 8 make every prompt span several SSD chunks."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.gate import gate_tiny_family
from tests.models.test_batch_invariance import (MAX_MODEL_LEN, PROMPTS, _agree, _check_batched_and_chunked, _outputs,
                                                _reschedule)
from tests.models.test_gate_transformers import PROMPTS as GATE_PROMPTS
from tests.tiny_models import make_tiny_checkpoint

MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_chunk_size=8, mamba_expand=2)


def _base(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)


def mamba2(vocab: int):
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, n_groups=2,
                        state_size=16, conv_kernel=4, chunk_size=8, expand=2, layer_norm_epsilon=1e-5,
                        residual_in_fp32=True, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0)


def granite_hybrid(vocab: int):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **_base(vocab), **MAMBA, layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, embedding_multiplier=2.0,
        attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0, position_embedding_type="nope",
        tie_word_embeddings=True)


def granite_hybrid_dense(vocab: int):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **_base(vocab), **{**MAMBA, "mamba_n_groups": 1}, layer_types=["full_attention", "linear_attention",
                                                                       "linear_attention", "full_attention"],
        num_local_experts=0, shared_intermediate_size=96, position_embedding_type="rope", tie_word_embeddings=False)


def bamba(vocab: int):
    from transformers import BambaConfig

    return BambaConfig(**{**_base(vocab), "intermediate_size": 96}, **{k: v for k, v in MAMBA.items()
                                                                      if k != "mamba_expand"},
                       mamba_expand=2, attn_layer_indices=[2], tie_word_embeddings=False)


def nemotron_h(vocab: int):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
        layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)


def falcon_h1(vocab: int, **overrides):
    from transformers import FalconH1Config

    return FalconH1Config(**{
        **_base(vocab), "intermediate_size": 96, "num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 128,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_chunk_size": 8, "mamba_rms_norm": False, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
        "mlp_multipliers": [0.8, 1.2], "key_multiplier": 0.7, "attention_in_multiplier": 1.1,
        "attention_out_multiplier": 0.9, "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 1.1], "ssm_in_multiplier": 1.3,
        "ssm_out_multiplier": 0.8, "tie_word_embeddings": False, **overrides})


def falcon_h1_norm(vocab: int):
    return falcon_h1(vocab, mamba_rms_norm=True, mamba_norm_before_gate=True)


# gate id -> (config builder, what the tiny config exercises: the gate report's description)
FAMILIES: dict[str, tuple[Callable[[int], object], str]] = {
    "Mamba2ForCausalLM": (mamba2, "3 Mamba2 layers (8 heads x 16, 2 groups, d_state 16, SSD chunk 8), fp32 "
                                  "residual, tied, no attention: the cache is seats only"),
    "GraniteMoeHybridForCausalLM": (granite_hybrid, "3 Mamba2 + 1 NoPE attention layer (GQA 4/2), 4 experts top-2 "
                                                    "+ shared MLP, Granite's 4 muP scalars, tied"),
    "GraniteMoeHybridForCausalLM/dense": (granite_hybrid_dense, "attention (rope) / 2 Mamba2 / attention, dense "
                                                                "shared MLP only, 1 group"),
    "NemotronHForCausalLM": (nemotron_h, "Mamba2 / relu^2 MLP / NoPE attention (GQA 4/2) / MLP / Mamba2, one mixer "
                                         "per layer, dt floor time_step_min"),
    "FalconH1ForCausalLM": (falcon_h1, "Mamba2 (d_ssm 128) beside attention (GQA 4/2) in every layer, no mixer "
                                       "norm (silu gate), the 10 muP multipliers incl. per-section ssm_multipliers"),
    "FalconH1ForCausalLM/rms-norm": (falcon_h1_norm, "mamba_rms_norm with norm_before_gate (2 groups)"),
    "BambaForCausalLM": (bamba, "Mamba2 x2, attention (half-rotary, GQA 4/2), Mamba2; gated MLP"),
}


def check_state_invariance(llm) -> None:
    """Batched, chunked (prompts split across steps continue the state), preempted and late arrivals."""
    one_at_a_time = [_outputs(llm, [p])[0] for p in PROMPTS]
    _check_batched_and_chunked(llm, one_at_a_time, 7)

    scheduler = _reschedule(llm, enable_prefix_caching=False, max_num_batched_tokens=16)
    layout = llm.engine.core.kv_cache_config.layout
    if layout.groups:  # the smallest pool that holds one sequence preempts the others
        scheduler = _reschedule(llm, num_blocks=layout.blocks_per_request(MAX_MODEL_LEN, 16),
                                enable_prefix_caching=False, max_num_batched_tokens=16)
    _preempt_during(llm, scheduler)
    _agree(one_at_a_time, _outputs(llm), "preempted")
    assert scheduler.stats().num_preemptions > 0, "nothing was preempted"
    assert scheduler.kv.seats.num_free == scheduler.kv.seats.num_seats, "a seat leaked"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def _preempt_during(llm, scheduler) -> None:
    """Preempt the latest running request every 5th step (a tight pool may preempt on its own as well):
    it must recompute its state from scratch in whatever seat it gets next."""
    core = llm.engine.core
    original, steps = core.scheduler.schedule, [0]

    def schedule():
        steps[0] += 1
        if steps[0] % 5 == 0 and len(scheduler.running) > 1:
            scheduler._preempt(scheduler._pick_victim())
        return original()

    scheduler.schedule = schedule


# One batched + chunked + preempted run for the Mamba2 mixer kind: the family with both cache kinds.
STATE_INVARIANCE = "GraniteMoeHybridForCausalLM"


@pytest.mark.parametrize("gate_id", list(FAMILIES))
def test_hybrid_matches_transformers_and_carries_state(gate_id, smollm2_tokenizer_dir, tmp_path, gate_report):
    make_config, description = FAMILIES[gate_id]
    gate_tiny_family(gate_id, make_config, description, smollm2_tokenizer_dir, tmp_path, gate_report, GATE_PROMPTS,
                     check_state_invariance, gate_id == STATE_INVARIANCE, max_num_seqs=8)


@pytest.fixture(scope="module")
def granite_dir(smollm2_tokenizer_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("granite_hybrid")
    make_tiny_checkpoint("GraniteMoeHybridForCausalLM", smollm2_tokenizer_dir, out, granite_hybrid)
    return str(out)


def test_seats_bound_max_num_seqs(granite_dir, caplog):
    """A budget too small for max_num_seqs states prints USAGE's reduction line and serves that many (the
    seats come first: prefix caching stays on, with the snapshots the rest affords, none here); one too
    small for a single state is refused before serving, with the arithmetic."""
    import logging

    from vllmpy import LLM
    from vllmpy.errors import KVCacheTooSmallError

    # One 256-token sequence's KV: 16 blocks x 1 layer x 4 KiB; each seat: 3 layers x 10496 B of state
    # (conv window 3 x 192 + SSM 8 x 16 x 16, float32).
    with caplog.at_level(logging.INFO, logger="vllmpy"):
        llm = LLM(model=granite_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16, max_num_seqs=8,
                  kv_cache_memory=16 * 4096 + 5 * 3 * 10496 + 100)
    core = llm.engine.core
    assert core.kv_cache_config.layout.state_bytes_per_seq == 3 * 10496
    assert ("recurrent-state budget: reduced max_num_seqs from 8 to 5. The KV pool (54 blocks) holds 15 unified "
            "pages of 41 tokens (one page = one 10496-byte Mamba2 state), and each sequence owns 3 of them. Raise "
            "--num-blocks / --kv-cache-memory for more concurrent sequences, or lower num_speculative_tokens."
            ) in caplog.messages
    assert core.config.scheduler.max_num_seqs == 5 == core.kv_cache_config.num_seats
    assert core.scheduler.kv.enable_caching and core.kv_cache_config.num_snapshots == 0
    assert any("; 0 prefix-cache snapshots of that state" in m for m in caplog.messages)
    assert not any("prefix caching is off" in m for m in caplog.messages)
    with pytest.raises(KVCacheTooSmallError, match=r"plus 3 x 10496 = 31488 bytes of recurrent state"):
        LLM(model=granite_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16,
            kv_cache_memory=16 * 4096 + 31000)


def test_ssm_cache_dtype_bfloat16(granite_dir):
    """--mamba-ssm-cache-dtype bfloat16 stores the SSM state in bf16 (conv window: the model dtype) and
    still follows the float32 state's greedy tokens (the first steps at least)."""
    from vllmpy import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for name in ("auto", "bfloat16"):
        llm = LLM(model=granite_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=64,
                  mamba_ssm_cache_dtype=name)
        conv, ssm = llm.engine.core.runner.recurrent_states[0]
        assert conv.dtype == torch.float32 and ssm.dtype == (torch.bfloat16 if name == "bfloat16" else torch.float32)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(GATE_PROMPTS, params, use_tqdm=False)]
    assert [t[:2] for t in outputs["auto"]] == [t[:2] for t in outputs["bfloat16"]]
