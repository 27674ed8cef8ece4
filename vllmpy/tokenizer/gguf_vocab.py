"""Translate a GGUF file's tokenizer metadata into the tokenizer.json it implies.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary. Writing the
equivalent tokenizer.json lets GGUF and Hugging Face checkpoints share one loading path (and one
merges check) in `tokenizer.py`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllmpy.errors import UnsupportedCheckpointError

# llama.cpp's token_type values.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_SPACE_MARK = "\u2581"

# Split patterns for byte-level vocabularies, as llama.cpp applies them per `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tiktoken's o200k_base (gpt-oss, GPT-4o, Llama 4): case-aware letter runs with the contraction as their
# suffix, digits in threes, a punctuation run taking a trailing '/'.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(use_regex=False)]}


_GPT2_STYLE = _byte_level(use_regex=True)
# StarCoder-family vocabularies were trained with every digit on its own.
_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)],
}

# `tokenizer.ggml.pre` -> (pre_tokenizer, ignore_merges). Llama 3 style vocabularies take a word that
# is itself a token whole, as llama.cpp and their tokenizer.json do. "default" is what older files
# without a pre-tokenizer name mean for a GPT-2 style vocabulary.
_PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo"), (_GPT2_STYLE, False)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
        (_split_then_bytes(_LLAMA3_SPLIT), True),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_split_then_bytes(_QWEN2_SPLIT), False)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_split_then_bytes(_GPT4O_SPLIT), False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (_DIGITS_THEN_GPT2, False),
    ),
}

# Gemma's scores are placeholders on its whitespace pieces; its file order is the merge order.
_ORDERED_BY_POSITION = ("gemma", "gemma2", "gemma3")


@dataclass(frozen=True)
class GgufTokenizer:
    """What a GGUF says about its tokenizer, in tokenizer.json form plus the named tokens."""

    tokenizer_json: dict[str, Any]
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    chat_template: str | None


def tokenizer_from_gguf(md: Mapping[str, Any]) -> GgufTokenizer:
    """Build the tokenizer.json a GGUF's `tokenizer.ggml.*` keys describe."""
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedCheckpointError("GGUF has no tokenizer.ggml.tokens: it carries no tokenizer")
    types = list(md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if kind == "llama":
        tokens, model, pre_tokenizer, decoder = _sentencepiece(md, list(tokens))
    elif kind == "gpt2":
        tokens, model, pre_tokenizer, decoder = _byte_level_bpe(md, list(tokens), types)
    else:
        raise UnsupportedCheckpointError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'llama', 'gpt2')"
        )

    def named(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = named("bos_token_id"), named("eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    return GgufTokenizer(
        tokenizer_json={
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": _added_tokens(tokens, types, model["vocab"]),
            "normalizer": None,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": _post_processor(bos if add_bos else None, eos if add_eos else None, model["vocab"]),
            "decoder": decoder,
            "model": model,
        },
        bos_token=bos,
        eos_token=eos,
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        chat_template=md.get("tokenizer.chat_template"),
    )


def _sentencepiece(md: Mapping[str, Any], tokens: list[str]) -> tuple[list[str], dict, dict, dict]:
    """A SentencePiece BPE vocabulary as a byte-fallback BPE whose merges follow the scores."""
    # Whitespace pieces are stored with real spaces; the text they meet has its spaces as U+2581.
    tokens = [t.replace(" ", _SPACE_MARK) if " " in t and not t.strip() else t for t in tokens]
    vocab = _vocab(tokens)
    if "tokenizer.ggml.merges" in md:
        merges = _split_merges(md["tokenizer.ggml.merges"])
    elif md.get("general.architecture") in _ORDERED_BY_POSITION:
        merges = _merges_from_vocab(tokens, [-float(i) for i in range(len(tokens))])
    else:
        merges = _merges_from_vocab(tokens, [float(s) for s in md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)])
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    model = _bpe_model(vocab, merges, unk=tokens[unk_id] if unk_id is not None else None, byte_fallback=True)
    pre_tokenizer = {
        "type": "Metaspace",
        "replacement": _SPACE_MARK,
        "prepend_scheme": "first" if prefix else "never",
        "split": False,
    }
    steps: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": _SPACE_MARK}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return tokens, model, pre_tokenizer, {"type": "Sequence", "decoders": steps}


def _byte_level_bpe(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[list[str], dict, dict, dict]:
    """A GPT-2 style byte-level BPE; `tokenizer.ggml.pre` names how text is split before merging."""
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedCheckpointError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre]
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    # Control and user-defined tokens stay as written: they are matched whole in the raw text.
    tokens = [
        t
        if kind in (_CONTROL, _USER_DEFINED) or set(t) <= alphabet
        else "".join(spelling[b] for b in t.encode("utf-8"))
        for t, kind in zip(tokens, types)
    ]
    merges = _split_merges(md.get("tokenizer.ggml.merges") or [])
    model = _bpe_model(_vocab(tokens), merges, unk=None, byte_fallback=False, ignore_merges=ignore_merges)
    return tokens, model, pre_tokenizer, _byte_level(use_regex=True)


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a repeated token keeps its first id."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _bpe_model(
    vocab: dict[str, int], merges: list[list[str]], *, unk: str | None, byte_fallback: bool, ignore_merges: bool = False
) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }


def _split_merges(merges: list[str]) -> list[list[str]]:
    """GGUF writes merges as "left right"; a malformed one is refused by `check_merges`."""
    return [merge.split(" ") for merge in merges]


def _merges_from_vocab(tokens: list[str], priority: list[float]) -> list[list[str]]:
    """Every way to build a token from two others, best token first.

    SentencePiece merges the adjacent pair whose joined piece scores highest, so each split of a
    piece becomes a merge ranked by that piece's score. Among splits of one piece the longer left
    part goes first, as the converted tokenizer.json files transformers writes do.
    """
    vocab = _vocab(tokens)
    ranked = []
    for index, token in enumerate(tokens):
        if vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-priority[index], -len(left), -len(right), index, vocab[left], vocab[right]))
    ranked.sort()
    return [[tokens[key[3]][: -key[1]], tokens[key[3]][-key[1] :]] for key in ranked]


def _added_tokens(tokens: list[str], types: list[int], vocab: dict[str, int]) -> list[dict[str, Any]]:
    """Control tokens as special tokens and user-defined ones as plain added tokens, so each encodes whole.

    A token spelled with U+2581 was a run of spaces in the file; the model reaches it through merges,
    so it is not matched against raw text.
    """
    added = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED) or vocab.get(token) != index or _SPACE_MARK in token:
            continue
        added.append(
            {
                "id": index,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": kind == _CONTROL,
            }
        )
    return added


def _post_processor(bos: str | None, eos: str | None, vocab: dict[str, int]) -> dict[str, Any]:
    """Wrap each sequence in the BOS/EOS the file asks to add."""

    def template(seq: str, type_id: int) -> list[dict]:
        items: list[dict] = [{"SpecialToken": {"id": bos, "type_id": type_id}}] if bos else []
        items.append({"Sequence": {"id": seq, "type_id": type_id}})
        if eos:
            items.append({"SpecialToken": {"id": eos, "type_id": type_id}})
        return items

    special = {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in (bos, eos) if t}
    return {
        "type": "TemplateProcessing",
        "single": template("A", 0),
        "pair": template("A", 0) + template("B", 1),
        "special_tokens": special,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest shift past U+00FF."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
