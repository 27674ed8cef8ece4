"""Sentence-pair scoring shared by LLM.score and /score, /rerank (vLLM's two ways): a cross-encoder
(task classify, one label) reads each pair as one prompt, `text_1 [SEP] text_2` with BERT's token types;
an embedding model embeds every distinct text once and scores a pair by the cosine of its two vectors."""
from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from vllmpy.outputs import EmbeddingRequestOutput
from vllmpy.pooling_params import PoolingParams
from vllmpy.tokenizer import Tokenizer


def as_texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def pair_up(text_1: list[str], text_2: list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] with text_2[i]."""
    if not text_1 or not text_2:
        raise ValueError(f"{'text_1' if not text_1 else 'text_2'} must hold at least one text")
    if len(text_1) == 1:
        return [(text_1[0], other) for other in text_2]
    if len(text_1) == len(text_2):
        return list(zip(text_1, text_2))
    raise ValueError(f"text_1 and text_2 must pair one to many (1 and N texts) or many to many (N and N), "
                     f"got {len(text_1)} and {len(text_2)}")


def check_scoring_task(task: str) -> None:
    if task == "generate":
        raise ValueError("model: this is a generative model (task generate); scoring needs a cross-encoder "
                         "(*ForSequenceClassification) or an embedding model (--task embed)")


class PairScorer:
    """The engine requests that score `pairs`, and the scores once their outputs are in."""

    def __init__(self, task: str, tokenizer: Tokenizer, pairs: list[tuple[str, str]], params: PoolingParams) -> None:
        self.cross_encoder = task == "classify"
        self.pairs = pairs
        if self.cross_encoder:
            if params.truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens is not supported for cross-encoder pairs (it would cut "
                                 "the query); shorten the texts")
            self.requests = [_pair_prompt(tokenizer, a, b, params) for a, b in pairs]
        else:
            self.texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            embed = dataclasses.replace(params, task="embed", use_activation=None)
            self.requests = [({"prompt": text}, embed) for text in self.texts]

    def scores(self, outputs: list[EmbeddingRequestOutput]) -> list[tuple[float, list[int]]]:
        """(score, the prompt tokens it read) per pair, outputs in `requests` order."""
        if self.cross_encoder:
            return [(o.outputs.embedding[0], o.prompt_token_ids) for o in outputs]
        by_text = dict(zip(self.texts, outputs))
        results = []
        for a, b in self.pairs:
            first, second = by_text[a], by_text[b]
            cosine = F.cosine_similarity(torch.tensor(first.outputs.embedding),
                                         torch.tensor(second.outputs.embedding), dim=0)
            results.append((float(cosine), first.prompt_token_ids + second.prompt_token_ids))
        return results


def _pair_prompt(tokenizer: Tokenizer, text_1: str, text_2: str, params: PoolingParams) -> tuple[dict, PoolingParams]:
    """The pair as the tokenizer's own pair template writes it (transformers' tokenizer(text, text_pair))."""
    encoding = tokenizer.backend.encode(text_1, text_2)
    split = encoding.type_ids.index(1) if 1 in encoding.type_ids else None
    extra = {**(params.extra_kwargs or {}), "compressed_token_type_ids": split} if split is not None else None
    return {"prompt_token_ids": encoding.ids}, dataclasses.replace(params, task="score", extra_kwargs=extra)
