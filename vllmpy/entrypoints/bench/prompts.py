"""Benchmark prompts: random token ids (exact input lengths, no tokenizer round trip) or a JSONL file."""
from __future__ import annotations

import json
import random
from collections.abc import Sequence

from vllmpy.tokenizer import Tokenizer


def usable_token_ids(tokenizer: Tokenizer, model_vocab_size: int) -> list[int]:
    """Ids a random prompt may use: inside the model's vocabulary and not special (no BOS/EOS mid-prompt)."""
    special = tokenizer.all_special_ids
    return [t for t in range(min(tokenizer.vocab_size, model_vocab_size)) if t not in special]


def random_token_prompts(vocab: Sequence[int], count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` ids; a fresh seed gives prompts that share no cached prefix."""
    rng = random.Random(seed)
    return [rng.choices(vocab, k=length) for _ in range(count)]


def load_jsonl(path: str, limit: int | None = None) -> list[dict]:
    """Prompts from a JSONL file: one object per line with "prompt" (text) or "prompt_token_ids" (ints)."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            prompts.append(_check_item(item, f"{path}:{number}"))
            if limit is not None and len(prompts) == limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _check_item(item: object, where: str) -> dict:
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return {"prompt": item["prompt"]}
    ids = item.get("prompt_token_ids") if isinstance(item, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return {"prompt_token_ids": ids}
    raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"prompt_token_ids": [ints]}}')
