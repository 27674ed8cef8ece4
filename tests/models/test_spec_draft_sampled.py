"""draft_model with draft_sample_method probabilistic: the draft samples each draft from its own distribution q,
the verifier keeps it with min(1, p/q) and resamples a reject from max(p - q, 0), so sampled spec-on keeps
spec-off's output distribution while a greedy request still gets spec-off's tokens.

The draft is a different random model of the target's 16-token vocabulary, sharpened (its head x 4) so q is
far from the target's p: a verifier that resampled rejects from p (or p without x) instead of max(p - q, 0)
would move the distribution well past the chi-square's critical value.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.test_spec_decode import (SAMPLED, _chi2_critical, _params, _small_vocab_llama, homogeneity_chi2,
                                           sampled_outcomes)
from tests.tiny_models import make_tiny_checkpoint

NUM_REQUESTS = 1500
HEAD_SCALE = 4.0  # the draft's lm_head x 4: a peaked q, unlike the target's flatter p


def _other_small_llama(vocab: int):
    config = _small_vocab_llama(vocab)
    config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings = 16, 1, False
    return config


@pytest.fixture(scope="module")
def checkpoints(smollm2_tokenizer_dir, tmp_path_factory) -> tuple[str, str]:
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, target, make_config=_small_vocab_llama)
    model = make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, draft, make_config=_other_small_llama)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(draft)
    return str(target), str(draft)


def _llm(target: str, **spec):
    from vllmpy import LLM

    return LLM(model=target, dtype="float32", max_model_len=32, block_size=4, num_blocks=2048, max_num_seqs=256,
               **({"speculative_config": spec} if spec else {}))


SPEC = {"num_speculative_tokens": 2, "draft_sample_method": "probabilistic", "disable_by_batch_size": 256}


def test_sampled_drafts_keep_the_distribution(checkpoints):
    """Chi-square (p = 0.001) over the first three tokens of 1,500 seeded requests, spec-on vs spec-off, at
    temperature 0.9 + top-k/p + penalties + logit bias; the drafts are sampled (each carries its q)."""
    target, draft = checkpoints
    off = sampled_outcomes(_llm(target), NUM_REQUESTS, **SAMPLED)
    spec = _llm(target, model=draft, **SPEC)
    sent = []
    runner = spec.engine.core.runner
    original = runner.execute
    runner.execute = lambda so: sent.extend(c.draft_probs for c in so.chunks if c.num_draft_tokens) or original(so)
    on = sampled_outcomes(spec, NUM_REQUESTS, **SAMPLED)
    stats = spec.engine.core.scheduler.drafter.stats
    assert sent and all(q is not None and q.shape[1] == 16 for q in sent), "drafts went out without their q"
    assert all(torch.allclose(q.sum(dim=1), torch.ones(q.shape[0])) for q in sent)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    stat, df = homogeneity_chi2(off, on)
    print(f"chi2 {stat:.1f} df {df} critical {_chi2_critical(df):.1f}; accepted {stats.num_accepted_tokens}"
          f"/{stats.num_draft_tokens}")
    assert stat < _chi2_critical(df), f"spec-on's distribution differs: chi2 {stat:.1f} on {df} df"


def test_greedy_requests_stay_exact_under_probabilistic_drafts(checkpoints):
    """temperature 0: the draft drafts its argmax (one-hot, no q) and the output is spec-off's."""
    target, draft = checkpoints
    prompts = [{"prompt_token_ids": p} for p in ([3, 5, 7, 3], [9, 4], [1, 2, 3, 4, 5, 6])]
    params = _params(max_tokens=10, logprobs=None)
    reference = [o.outputs[0].token_ids for o in _llm(target).generate(prompts, params, use_tqdm=False)]
    spec = _llm(target, model=draft, **SPEC)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == reference
    assert spec.engine.core.scheduler.drafter.stats.num_draft_tokens > 0


def test_probabilistic_is_for_draft_models_only():
    from vllmpy.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse({"model": "/d.gguf", "num_speculative_tokens": 2,
                                      "draft_sample_method": "probabilistic"})
    assert "probabilistic drafts" in config.describe()
    with pytest.raises(ValueError, match="draft_sample_method must be 'greedy' for method 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "draft_sample_method": "probabilistic"})
    with pytest.raises(ValueError, match="must be 'greedy' or 'probabilistic', got 'gumbel'"):
        SpeculativeConfig.parse({"model": "/d.gguf", "num_speculative_tokens": 2, "draft_sample_method": "gumbel"})
