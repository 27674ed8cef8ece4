"""`mtp` speculation: the target checkpoint's MTP block drafts (DeepSeek-V3, GLM-4.5), greedy spec-on gives
spec-off's tokens and logprobs, and the block's drafts equal a torch reference of its formula.

Checkpoints: a tiny random target saved by transformers (which has no MTP module), then an MTP block
written into its safetensors under the real names (`model.layers.{num_hidden_layers}.*`): its decoder layer
is layer 0 of a one-layer random transformers model of the same family (saved by transformers, so in the
checkpoint's names), its final norm and head are shared_head.norm / shared_head.head, plus random enorm,
hnorm and eh_proj. That one-layer model is also the reference: fed eh_proj(cat(enorm(embed(x[t+1])),
hnorm(h[t]))) with h the target's final hidden states, it computes the block's logits.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.test_mla_models import deepseek_v3, glm4_moe_lite
from tests.models.test_moe_families import glm4_moe
from tests.models.test_spec_decode import PROMPTS, _params, _respec, _spec_off
from tests.tiny_models import make_tiny_checkpoint, randomize

K = 3
MAX_MODEL_LEN = 64


class MTPCheckpoint:
    """A tiny target with an MTP block, and the transformers models that compute what it should."""

    def __init__(self, path: Path, target, block, own_embed_and_head: bool, enorm: torch.Tensor | None = None,
                 eh_proj: torch.Tensor | None = None) -> None:
        self.path, self.target, self.block = str(path), target, block
        hidden = target.config.hidden_size
        gen = torch.Generator().manual_seed(1)
        self.enorm = 1 + 0.3 * torch.randn(hidden, generator=gen) if enorm is None else enorm
        self.hnorm = 1 + 0.3 * torch.randn(hidden, generator=gen)
        self.eh_proj = 0.15 * torch.randn(hidden, 2 * hidden, generator=gen) if eh_proj is None else eh_proj
        self.eps = target.config.rms_norm_eps
        if not own_embed_and_head:  # the block shares the target's (the reference must too)
            block.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
            block.lm_head.weight.data.copy_(target.lm_head.weight)
        self._write(own_embed_and_head)

    def _write(self, own_embed_and_head: bool) -> None:
        n = self.target.config.num_hidden_layers
        file = Path(self.path) / "model.safetensors"
        tensors = load_file(file)
        saved = Path(self.path) / "block"
        self.block.save_pretrained(saved)
        prefix = f"model.layers.{n}."
        for name, tensor in load_file(saved / "model.safetensors").items():
            if name.startswith("model.layers.0."):
                tensors[prefix + name[len("model.layers.0."):]] = tensor
            elif own_embed_and_head and name in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
                mine = {"model.norm.weight": "shared_head.norm.weight", "lm_head.weight": "shared_head.head.weight",
                        "model.embed_tokens.weight": "embed_tokens.weight"}[name]
                tensors[prefix + mine] = tensor
        if not own_embed_and_head:
            tensors[prefix + "shared_head.norm.weight"] = self.block.model.norm.weight.detach().clone()
        tensors |= {prefix + "enorm.weight": self.enorm, prefix + "hnorm.weight": self.hnorm,
                    prefix + "eh_proj.weight": self.eh_proj}
        save_file(tensors, file, metadata={"format": "pt"})

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _input(self, token: torch.Tensor, hidden: torch.Tensor, first: bool) -> torch.Tensor:
        embed = self.block.model.embed_tokens(token)
        if first:
            embed = torch.zeros_like(embed)
        return torch.cat([self._rms(embed, self.enorm), self._rms(hidden, self.hnorm)], -1) @ self.eh_proj.T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The block's k chained drafts after the verified `tokens` (torch reference)."""
        ids = torch.tensor([tokens])
        hidden = self.target.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # after the final norm
        rows = [self._input(ids[0, t + 1], hidden[t], t == 0) for t in range(len(tokens) - 1)]
        outputs = []
        hook = self.block.model.norm.register_forward_hook(lambda _m, args, _o: outputs.append(args[0]))
        drafts = []
        try:
            for _ in range(k):
                logits = self.block(inputs_embeds=torch.stack(rows)[None]).logits[0, -1]
                drafts.append(int(logits.argmax()))
                rows.append(self._input(torch.tensor(drafts[-1]), outputs[-1][0, -1], False))
        finally:
            hook.remove()
        return drafts


def _branches(model):
    """The weights whose outputs join the residual stream: attention o_proj and every MLP's down_proj."""
    return [p for name, p in model.named_parameters() if "o_proj" in name or "down_proj" in name]


def make_mtp_checkpoint(arch: str, make_config, tokenizer_dir: str, out: Path, own: bool,
                        predictive: bool = False) -> MTPCheckpoint:
    """predictive: a target whose layers barely touch the residual stream (branches x 1e-4: it predicts the
    next token from the current one) and a block built to predict as it does one position ahead -- an
    identity decoder layer (branches 0), eh_proj reading only the next token's embedding, enorm the target's
    final norm, the target's head -- so its drafts are mostly accepted."""
    from transformers import AutoModelForCausalLM

    def config(vocab: int):
        c = make_config(vocab)
        c.num_nextn_predict_layers = 1
        return c

    target = make_tiny_checkpoint(arch, tokenizer_dir, out, make_config=config).eval()
    block_config = copy.deepcopy(target.config)
    block_config.num_hidden_layers, block_config.first_k_dense_replace = 1, 0  # its one layer sparse, as the MTP's
    if getattr(block_config, "mlp_layer_types", None):  # GLM-4.7-Flash lists each layer's kind
        block_config.mlp_layer_types = ["sparse"]
    block = AutoModelForCausalLM.from_config(block_config, dtype=torch.float32).eval()
    torch.manual_seed(2)
    randomize(block)
    if not predictive:
        return MTPCheckpoint(out, target, block, own)
    with torch.no_grad():
        for p in _branches(target):
            p.mul_(1e-4)
        for p in _branches(block):
            p.zero_()
        block.model.norm.weight.fill_(1.0)
    target.save_pretrained(out)
    hidden = target.config.hidden_size
    eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    return MTPCheckpoint(out, target, block, own, enorm=target.model.norm.weight.detach().clone(), eh_proj=eh_proj)


def _mtp_llm(path: str, **kwargs):
    from vllmpy import LLM

    return LLM(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4, enable_prefix_caching=False,
               speculative_config={"method": "mtp", "num_speculative_tokens": K}, **kwargs)


def _outputs(llm, prompts, **overrides):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, _params(**overrides), use_tqdm=False)]


def _assert_same(reference, ours, label: str) -> None:
    """Greedy spec-on == spec-off: the same tokens, logprobs within 1e-5."""
    for i, ((ref_tokens, ref_lps), (tokens, lps)) in enumerate(zip(reference, ours, strict=True)):
        assert tokens == ref_tokens, f"{label}: prompt {i}: {tokens} vs spec-off {ref_tokens}"
        for step, (a, b) in enumerate(zip(ref_lps, lps, strict=True)):
            for token_id, lp in a.items():
                assert abs(lp.logprob - b[token_id].logprob) < 1e-5, f"{label}: prompt {i} step {step} token {token_id}"


def _record_proposals(llm) -> list[tuple[list[int], list[int]]]:
    """(verified tokens, drafts) of every request each step, as the proposer returns them."""
    proposer = llm.engine.core.scheduler.drafter.proposer
    seen, original = [], proposer.propose_batch

    def record(batch):
        drafts = original(batch)
        seen.extend((list(request.token_ids), list(d)) for request, d in zip(batch, drafts))
        return drafts

    proposer.propose_batch = record
    return seen


def _gate(ckpt: MTPCheckpoint, label: str, min_acceptance: float) -> None:
    llm = _mtp_llm(ckpt.path, num_blocks=128)
    proposals = _record_proposals(llm)
    stats = llm.engine.core.scheduler.drafter.stats
    reference = _spec_off(llm, lambda: _outputs(llm, PROMPTS))
    _assert_same(reference, _outputs(llm, PROMPTS), label)
    assert stats.num_draft_tokens > 0, f"{label}: nothing was drafted"
    print(f"{label}: acceptance {stats.acceptance_rate:.2f}, mean length {stats.mean_acceptance_length:.2f}")
    assert stats.acceptance_rate >= min_acceptance

    # The oracle: the first proposals of the batch equal the torch reference of the block's formula.
    checked = 0
    for tokens, drafts in proposals[:12]:
        if drafts:
            assert drafts == ckpt.drafts(tokens, len(drafts)), f"{label}: drafts after {len(tokens)} tokens"
            checked += 1
    assert checked >= 6, f"{label}: only {checked} proposals to check"
    core = llm.engine.core
    assert core.scheduler.kv.num_free_blocks == core.num_blocks
    proposer = core.scheduler.drafter.proposer
    assert not proposer._seqs and proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.fixture(scope="module")
def deepseek(smollm2_tokenizer_dir, tmp_path_factory) -> MTPCheckpoint:
    return make_mtp_checkpoint("DeepseekV3ForCausalLM", deepseek_v3, smollm2_tokenizer_dir,
                               tmp_path_factory.mktemp("deepseek_mtp"), own=True)


def test_deepseek_v3_mtp_matches_reference_and_spec_off(deepseek):
    """Its own embed_tokens and shared_head.head (DeepSeek-V3's layout); a mixed batch of 4 prompts."""
    _gate(deepseek, "deepseek-v3 mtp", min_acceptance=0.0)


def test_deepseek_v3_mtp_accepted_chunked_and_preempted(smollm2_tokenizer_dir, tmp_path):
    """A block that predicts as the target does (most drafts kept, k = 3), prompts fed in chunks of 8 (the block
    reads each chunk's rows) and a target pool small enough to preempt."""
    ckpt = make_mtp_checkpoint("DeepseekV3ForCausalLM", deepseek_v3, smollm2_tokenizer_dir, tmp_path, own=False,
                               predictive=True)
    llm = _mtp_llm(ckpt.path, num_blocks=128, max_num_batched_tokens=8)
    stats = llm.engine.core.scheduler.drafter.stats
    reference = _spec_off(llm, lambda: _outputs(llm, PROMPTS))
    _assert_same(reference, _outputs(llm, PROMPTS), "predictive block, chunked")
    print(f"predictive: acceptance {stats.acceptance_rate:.2f}, mean length {stats.mean_acceptance_length:.2f}")
    assert stats.acceptance_rate > 0.9
    blocks = llm.engine.core.kv_cache_config.layout.blocks_per_request(MAX_MODEL_LEN, 8)
    scheduler = _respec(llm, num_blocks=blocks, max_num_batched_tokens=8, enable_prefix_caching=False)
    preempted, proposer = [], scheduler.drafter.proposer
    original = proposer.on_request_preempted
    proposer.on_request_preempted = lambda req_id: preempted.append(req_id) or original(req_id)
    drafted = stats.num_draft_tokens
    reference = _spec_off(llm, lambda: _outputs(llm, PROMPTS, max_tokens=40))  # two long requests fill the pool
    _assert_same(reference, _outputs(llm, PROMPTS, max_tokens=40), "predictive block, chunked, preempted")
    assert preempted, "the small pool caused no preemption with speculation on"
    assert stats.num_draft_tokens > drafted
    assert not proposer._seqs and proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_glm4_moe_mtp_shares_the_targets_embedding_and_head(smollm2_tokenizer_dir, tmp_path):
    """GLM-4.5's MTP block without embed_tokens / shared_head.head of its own: the target's are used."""
    ckpt = make_mtp_checkpoint("Glm4MoeForCausalLM", glm4_moe, smollm2_tokenizer_dir, tmp_path, own=False)
    _gate(ckpt, "glm-4.5 mtp", min_acceptance=0.0)


def test_refusals(deepseek, smollm2_tokenizer_dir, tmp_path):
    """No MTP layers (num_nextn_predict_layers 0 or absent, or no tensors), an architecture without MTP."""
    import json
    import shutil

    from vllmpy import LLM

    for value in (0, None):
        out = tmp_path / f"nextn_{value}"
        shutil.copytree(deepseek.path, out, ignore=shutil.ignore_patterns("block"))
        config = json.loads((out / "config.json").read_text())
        config.pop("num_nextn_predict_layers")
        if value is not None:
            config["num_nextn_predict_layers"] = value
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="this checkpoint has no MTP layers"):
            _mtp_llm(str(out), num_blocks=32)
    bare = tmp_path / "bare"  # transformers' DeepseekV3Config says num_nextn_predict_layers 1 but saves none
    make_tiny_checkpoint("DeepseekV3ForCausalLM", smollm2_tokenizer_dir, bare, make_config=deepseek_v3)
    with pytest.raises(ValueError, match=r"no MTP layers \(no tensor named model.layers.3.\*"):
        _mtp_llm(str(bare), num_blocks=32)
    llama = tmp_path / "llama"
    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, llama)
    with pytest.raises(ValueError, match="'mtp' needs an architecture with MTP heads .* LlamaForCausalLM has none"):
        LLM(model=str(llama), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_glm4_moe_lite_mtp(smollm2_tokenizer_dir, tmp_path):
    """GLM-4.7-Flash (DeepSeek-V3's block, MLA, rotate-half rope) with its own embedding and head."""
    ckpt = make_mtp_checkpoint("Glm4MoeLiteForCausalLM", glm4_moe_lite, smollm2_tokenizer_dir, tmp_path, own=True)
    _gate(ckpt, "glm-4.7-flash mtp", min_acceptance=0.0)
