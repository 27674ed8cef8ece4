"""Scoring gate: LLM.score / LLM.classify / LLM.encode vs transformers (fp32) on tiny random checkpoints,
values within 1e-5: BERT and XLM-R cross-encoders (pairs with BERT's token types), a BERT classifier
with id2label, a Qwen3ForSequenceClassification decoder reranker, RoBERTa / XLM-R embedding encoders,
and an embedding model's cosine score (all-MiniLM-L6-v2). Plus the refusals, each naming its cause."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from vllmpy import LLM, PoolingParams

TOL = 1e-5
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "The quick brown fox jumps over the lazy dog.",
        "Berlin is the capital of Germany.", "Ünïcödé and 12345 numbers"]
LABELS = {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
          "label2id": {"negative": 0, "neutral": 1, "positive": 2}}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _save(model: torch.nn.Module, tokenizer_dir: str, out: Path) -> str:
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


def save_encoder(model_cls: str, tokenizer_dir: str, out: Path, **config) -> tuple[str, torch.nn.Module]:
    """A random-weight transformers `model_cls` ("BertForSequenceClassification", ...) saved with the
    tokenizer's files; returns (dir, the transformers model)."""
    import transformers

    torch.manual_seed(0)
    kind = "bert" if model_cls.startswith("Bert") else "xlmr"
    extra = {"add_pooling_layer": False} if model_cls.endswith("Model") else {}
    model = getattr(transformers, model_cls)(_encoder_config(kind, **config), **extra).eval()
    return _save(model, tokenizer_dir, out), model


def _encoder_config(kind: str, **extra):
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, initializer_range=0.2, hidden_act="gelu", **extra)
    if kind == "bert":
        return BertConfig(max_position_embeddings=128, **common)
    # pad 0: the MiniLM (BERT WordPiece) tokenizer's [PAD], which RoBERTa's positions count from
    return XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=0, **common)


@pytest.fixture(scope="module")
def tiny_encoders(minilm_path, tmp_path_factory):
    """name → (checkpoint dir, transformers model): BERT / XLM-R cross-encoders, a 3-label BERT classifier,
    an XLM-R embedding model."""
    models = {
        "bert_ce": ("BertForSequenceClassification", {"num_labels": 1}),
        "xlmr_ce": ("XLMRobertaForSequenceClassification", {"num_labels": 1}),
        "bert_cls": ("BertForSequenceClassification", LABELS),
        "xlmr_embed": ("XLMRobertaModel", {}),
    }
    return {name: save_encoder(cls, minilm_path, tmp_path_factory.mktemp(name), **config)
            for name, (cls, config) in models.items()}


def reference_pairs(path: str, model, pairs: list[tuple[str, str]], token_types: bool) -> tuple[torch.Tensor, list]:
    """transformers' cross-encoder: tokenizer(text, text_pair) over a padded batch → logits."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    if not token_types:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    with torch.no_grad():
        logits = model(**batch).logits
    ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return logits, ids


def _close(ours: list[float], ref: torch.Tensor) -> float:
    return float((torch.tensor(ours) - ref.float()).abs().max())


@pytest.mark.parametrize("name", ["bert_ce", "xlmr_ce"])
def test_cross_encoder_scores_match_transformers(tiny_encoders, name):
    path, reference = tiny_encoders[name]
    llm = LLM(path)
    assert llm.engine.core.task == "classify"
    pairs = [(QUERY, doc) for doc in DOCS]
    logits, ids = reference_pairs(path, reference, pairs, token_types=name == "bert_ce")
    outputs = llm.score(QUERY, DOCS, use_tqdm=False)  # one to many
    assert [o.prompt_token_ids for o in outputs] == ids
    scores = [o.outputs.score for o in outputs]
    assert _close(scores, torch.sigmoid(logits[:, 0])) <= TOL  # one label: sigmoid, as vLLM
    raw = llm.score([QUERY] * 2, DOCS[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert _close([o.outputs.score for o in raw], logits[:2, 0]) <= TOL  # many to many, raw logits
    assert len({round(s, 6) for s in scores}) == len(scores)  # the pairs really differ


def test_bert_token_types_matter(tiny_encoders):
    """Dropping the second segment's token type 1 would move every score: the gate above checks it."""
    path, reference = tiny_encoders["bert_ce"]
    pairs = [(QUERY, DOCS[0])]
    with_types, _ = reference_pairs(path, reference, pairs, token_types=True)
    without, _ = reference_pairs(path, reference, pairs, token_types=False)
    assert float((with_types - without).abs().max()) > 1e-3


def test_cross_encoder_identity_activation_from_sentence_transformers_config(tiny_encoders, tmp_path):
    src, reference = tiny_encoders["bert_ce"]
    path = tmp_path / "ms_marco_style"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (path / "config.json").write_text(json.dumps(config))
    logits, _ = reference_pairs(str(path), reference, [(QUERY, DOCS[0])], token_types=True)
    assert _close([LLM(str(path)).score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score], logits[:, 0]) <= TOL


def test_classify_softmax_probs_match_transformers(tiny_encoders):
    from transformers import AutoTokenizer

    path, reference = tiny_encoders["bert_cls"]
    llm = LLM(path)
    outputs = llm.classify(DOCS, use_tqdm=False)
    batch = AutoTokenizer.from_pretrained(path)(DOCS, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = torch.softmax(reference(**batch).logits, dim=-1)
    assert _close([o.outputs.probs for o in outputs], probs) <= TOL
    assert all(o.outputs.num_classes == 3 for o in outputs)
    encoded = llm.encode(DOCS[0], use_tqdm=False)[0].outputs.data
    assert isinstance(encoded, torch.Tensor) and _close(encoded.tolist(), probs[0]) <= TOL
    with pytest.raises(ValueError, match="^model: scoring needs a cross-encoder with one output label"):
        llm.score(QUERY, DOCS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="^model: this is a classification model"):
        llm.embed("hi", use_tqdm=False)


def test_xlm_roberta_embeddings_match_transformers(tiny_encoders):
    from transformers import AutoTokenizer

    path, reference = tiny_encoders["xlmr_embed"]
    llm = LLM(path)
    assert llm.engine.core.max_model_len == 129  # 130 position rows, the first read at pad_token_id + 1
    outputs = llm.embed(DOCS, use_tqdm=False)
    batch = AutoTokenizer.from_pretrained(path)(DOCS, padding=True, return_tensors="pt")
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    with torch.no_grad():
        cls = F.normalize(reference(**batch).last_hidden_state[:, 0], dim=-1)  # CLS pooling, vLLM's default
    assert _close([o.outputs.embedding for o in outputs], cls) <= TOL
    with pytest.raises(ValueError, match="^model: this is an embedding model; it has no classification head"):
        llm.classify("hi", use_tqdm=False)


def test_qwen3_decoder_reranker_matches_transformers(smollm2_tokenizer_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.tiny_models import _configs
    from vllmpy.tokenizer import Tokenizer

    config = _configs(Tokenizer.from_pretrained(smollm2_tokenizer_dir).vocab_size)["Qwen3ForCausalLM"]
    config.num_labels, config.architectures = 1, ["Qwen3ForSequenceClassification"]
    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.15) if p.dim() > 1 else p.fill_(1.0)
    path = _save(reference, smollm2_tokenizer_dir, tmp_path / "qwen3_reranker")
    llm = LLM(path, max_model_len=256, num_blocks=64)
    outputs = llm.score(QUERY, DOCS, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for doc, output in zip(DOCS, outputs):
        ids = tokenizer(QUERY, doc, return_tensors="pt")["input_ids"]
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            logit = reference(input_ids=ids).logits[0, 0]  # the last token's score head
        assert abs(output.outputs.score - float(torch.sigmoid(logit))) <= TOL


def test_embedding_model_scores_by_cosine(minilm_path):
    from tests.models.test_embeddings import sentence_transformers_reference

    llm = LLM(minilm_path)
    outputs = llm.score(QUERY, DOCS, use_tqdm=False)
    vectors, _ = sentence_transformers_reference(minilm_path, [QUERY, *DOCS])
    expected = F.cosine_similarity(vectors[:1], vectors[1:], dim=-1)
    assert _close([o.outputs.score for o in outputs], expected) <= TOL
    assert max(range(len(DOCS)), key=lambda i: outputs[i].outputs.score) == 0  # Paris answers it
    with pytest.raises(ValueError, match="^text_1 and text_2 must pair one to many"):
        llm.score([QUERY, QUERY], DOCS[:3], use_tqdm=False)


def test_generative_model_refuses_to_score(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, num_blocks=64)
    with pytest.raises(ValueError, match="^model: this is a generative model"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="generative model"):
        llm.classify("hi", use_tqdm=False)
