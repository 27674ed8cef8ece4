"""Embedding gate: LLM.embed vs transformers (fp32) on the same weights, plus batching invariance.

Real weights: all-MiniLM-L6-v2 (BertModel, mean pooling + Normalize from its sentence-transformers files),
referenced as sentence-transformers computes it: AutoModel over a padded batch, attention-masked mean,
L2 normalize. Tiny random decoders: a bare LlamaModel checkpoint and a Qwen3ForCausalLM under
--task embed (LAST pooling), and a Qwen3 with a sentence-transformers MEAN config and no Normalize.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from vllmpy import LLM, PoolingParams, SamplingParams

COSINE_MIN = 0.99999
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings map sentences with similar meaning to nearby vectors; cosine similarity compares them.",
    "Ünïcödé, emoji 🙂 and numbers 12345 — tokenizers split these into many pieces!",
    " ".join(f"word{i}" for i in range(60)),
]


def _cosines(ours: list[list[float]], ref: torch.Tensor) -> list[float]:
    return [float(F.cosine_similarity(torch.tensor(o), r, dim=0)) for o, r in zip(ours, ref)]


def _vectors(outputs) -> list[list[float]]:
    return [o.outputs.embedding for o in outputs]


def _assert_same(a: list[list[float]], b: list[list[float]], tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert float((torch.tensor(x) - torch.tensor(y)).abs().max()) <= tol


# ---------------------------------------------------------------- all-MiniLM-L6-v2 (BertModel)


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return LLM(minilm_path)


def sentence_transformers_reference(path: str, texts: list[str]) -> tuple[torch.Tensor, list[list[int]]]:
    """sentence-transformers' pipeline by hand: its pooling mode from 1_Pooling, then Normalize."""
    from transformers import AutoModel, AutoTokenizer

    pooling = json.loads((Path(path) / "1_Pooling" / "config.json").read_text())
    modules = [m["type"] for m in json.loads((Path(path) / "modules.json").read_text())]
    assert pooling["pooling_mode_mean_tokens"] and "sentence_transformers.models.Normalize" in modules
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    ids = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch["input_ids"], batch["attention_mask"])]
    return F.normalize(mean, dim=-1), ids


def test_minilm_matches_sentence_transformers_pipeline(minilm, minilm_path):
    outputs = minilm.embed(TEXTS, use_tqdm=False)
    ref, ref_ids = sentence_transformers_reference(minilm_path, TEXTS)
    assert [o.prompt_token_ids for o in outputs] == ref_ids
    cosines = _cosines(_vectors(outputs), ref)
    print(f"all-MiniLM-L6-v2 cosine vs transformers: min={min(cosines):.8f} "
          f"({', '.join(f'{c:.8f}' for c in cosines)})")
    assert min(cosines) >= COSINE_MIN
    assert all(len(o.outputs.embedding) == 384 for o in outputs)
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1.0) < 1e-5 for o in outputs)
    assert minilm.engine.core.max_model_len == 256  # sentence_bert_config.json max_seq_length, as vLLM


def test_minilm_batching_invariance(minilm):
    batched = _vectors(minilm.embed(TEXTS, use_tqdm=False))
    alone = [minilm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    _assert_same(alone, batched)


def test_minilm_pooling_params_and_refusals(minilm):
    raw = minilm.embed("Hello world", pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0]
    assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1.0) > 1e-3
    long_text = " ".join(["token"] * 400)
    out = minilm.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 10
    assert out.prompt_token_ids[0] == 101 and out.prompt_token_ids[-1] == 102  # [CLS] ... [SEP] kept
    assert len(minilm.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids) == 256
    with pytest.raises(ValueError, match="maximum context length is 256"):
        minilm.embed(long_text, use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions: .*Matryoshka"):
        minilm.embed("hi", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="embedding model"):
        minilm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        minilm.embed([[101, 10**6, 102]], use_tqdm=False)
    assert minilm.embed("still serving", use_tqdm=False)[0].outputs.hidden_size == 384


def test_bert_refuses_max_model_len_past_its_positions(minilm_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(minilm_path, max_model_len=1024)


def test_vllm_cli_refuses_an_embedding_model(minilm_path, capsys):
    from vllmpy.entrypoints.cli import main

    assert main(["--model", minilm_path, "--prompt", "hi"]) == 2
    assert "embedding model" in capsys.readouterr().err


# ---------------------------------------------------------------- tiny random decoders


@pytest.fixture(scope="module")
def tiny_decoders(smollm2_tokenizer_dir, tmp_path_factory):
    """(bare LlamaModel dir, its transformers model), (Qwen3ForCausalLM dir, its base model)."""
    from tests.tiny_models import make_tiny_checkpoint

    llama = make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, tmp_path_factory.mktemp("llama_full"))
    bare_dir = tmp_path_factory.mktemp("llama_bare")
    llama.model.save_pretrained(bare_dir)  # architectures: ["LlamaModel"], tensors without `model.`
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_tokenizer_dir) / name, bare_dir / name)
    qwen_dir = tmp_path_factory.mktemp("qwen3")
    qwen = make_tiny_checkpoint("Qwen3ForCausalLM", smollm2_tokenizer_dir, qwen_dir)
    return (str(bare_dir), llama.model), (str(qwen_dir), qwen.model)


def _decoder_hidden(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


def _prompts() -> list[str]:
    return [f"Prompt {i}: " + " ".join(["alpha", "beta", "gamma", "delta"] * (2 + 4 * i)) for i in range(4)]


@pytest.mark.parametrize("which", ["LlamaModel", "Qwen3ForCausalLM --task embed"])
def test_decoder_last_token_pooling_matches_transformers(tiny_decoders, which):
    path, reference = tiny_decoders[0] if which == "LlamaModel" else tiny_decoders[1]
    kwargs = {} if which == "LlamaModel" else {"task": "embed"}
    llm = LLM(path, max_model_len=256, num_blocks=64, **kwargs)
    assert llm.engine.core.pooler.config.pooling_type == "LAST"
    outputs = llm.embed(_prompts(), use_tqdm=False)
    ref = torch.stack([F.normalize(_decoder_hidden(reference, o.prompt_token_ids)[-1], dim=0) for o in outputs])
    cosines = _cosines(_vectors(outputs), ref)
    print(f"{which} cosine vs transformers: min={min(cosines):.8f}")
    assert min(cosines) >= COSINE_MIN


def test_decoder_batching_invariance_chunked_and_cached(tiny_decoders):
    """LAST pooling keeps chunked prefill and the prefix cache; neither may move a vector."""
    path, _ = tiny_decoders[1]
    prompts = _prompts()
    llm = LLM(path, task="embed", max_model_len=256, num_blocks=64, max_num_batched_tokens=16)
    batched = _vectors(llm.embed(prompts, use_tqdm=False))  # chunks of 16 tokens across prompts
    cached = _vectors(llm.embed(prompts, use_tqdm=False))  # prefix-cache hits on every full block
    assert llm.engine.core.scheduler.kv.prefix_cache_hits > 0
    alone = [_vectors(llm.embed(p, use_tqdm=False))[0] for p in prompts]
    big = LLM(path, task="embed", max_model_len=256, num_blocks=64, enable_prefix_caching=False)
    whole = _vectors(big.embed(prompts, use_tqdm=False))
    for other in (cached, alone, whole):
        _assert_same(batched, other)


def test_decoder_sentence_transformers_mean_without_normalize(tiny_decoders, tmp_path):
    """modules.json decides: MEAN pooling, no Normalize module → raw mean; whole prompts in one step."""
    src, reference = tiny_decoders[1]
    path = tmp_path / "st"
    shutil.copytree(src, path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    llm = LLM(str(path), task="embed", max_model_len=256, num_blocks=64, max_num_batched_tokens=16)
    assert not llm.engine.core.config.scheduler.enable_chunked_prefill  # MEAN needs the whole prompt
    outputs = llm.embed(_prompts(), use_tqdm=False)
    for o in outputs:
        ref = _decoder_hidden(reference, o.prompt_token_ids).mean(0)
        assert float((torch.tensor(o.outputs.embedding) - ref).abs().max()) < 1e-4
        assert float(F.cosine_similarity(torch.tensor(o.outputs.embedding), ref, dim=0)) >= COSINE_MIN


def test_matryoshka_dimensions_and_refused_pooling(tiny_decoders, tmp_path):
    src, reference = tiny_decoders[1]
    path = tmp_path / "mrl"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(path), task="embed", max_model_len=256, num_blocks=64)
    out = llm.embed("Hello there", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
    ref = F.normalize(_decoder_hidden(reference, out.prompt_token_ids)[-1][:16], dim=0)  # truncate, then normalize
    assert len(out.outputs.embedding) == 16
    assert float(F.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0)) >= COSINE_MIN
    with pytest.raises(ValueError, match="dimensions must be one of"):
        llm.embed("Hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)

    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        LLM(str(path), task="embed", max_model_len=256, num_blocks=64)


def test_generative_model_refuses_embed(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, num_blocks=64)
    with pytest.raises(ValueError, match="generative model .* --task embed"):
        llm.embed("hi", use_tqdm=False)
    assert llm.generate("hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
