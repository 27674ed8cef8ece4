"""The engine's tokenizer: a `tokenizers` backend plus the special tokens and chat template around it.

Hugging Face directories and GGUF files both end up as a tokenizer.json (GGUF's is written by
`gguf_vocab`), so encoding and decoding behave the same whichever checkpoint format was loaded.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from vllmpy.tokenizer.errors import ChatTemplateError
from vllmpy.tokenizer.gguf_cache import load_or_build
from vllmpy.tokenizer.gguf_vocab import GgufTokenizer, tokenizer_from_gguf

# Named special tokens transformers registers as special, so they encode whole and are skipped on decode.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class Tokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        named_tokens: dict[str, tokenizers.AddedToken],
        *,
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        # A tokenizer.json may carry the padding / truncation it was exported with (all-MiniLM's pads every
        # prompt to 128); transformers turns both off unless a call asks, and so do we.
        backend.no_padding()
        backend.no_truncation()
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens([t for t in named_tokens.values() if t.content not in present])
        self._named = {name: t.content for name, t in named_tokens.items()}
        self.chat_template = chat_template
        # transformers only cleans up for non-BPE models: on BPE it deletes real spaces.
        self._clean_up = clean_up_tokenization_spaces and not isinstance(backend.model, tokenizers.models.BPE)
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        named_ids = (self.bos_token_id, self.eos_token_id, self.pad_token_id, self._id_of("unk_token"))
        self.all_special_ids: set[int] = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids |= {i for i in named_ids if i is not None}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json and the tokenizer_config.json / special_tokens_map.json beside it.

        Whether encode() adds BOS/EOS is up to tokenizer.json's post-processor alone: transformers 5
        drops the config's add_bos_token/add_eos_token whenever a tokenizer.json exists.
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer: {directory} has no tokenizer.json (only that tokenizer format is supported)")
        text = tokenizer_file.read_text(encoding="utf-8")
        spec = json.loads(text)
        check_merges(spec.get("model") or {})
        backend = tokenizers.Tokenizer.from_str(text)

        config = _read_json(directory / "tokenizer_config.json")
        values = dict(config)
        # As transformers: special_tokens_map.json is the legacy source, read when the config lacks added_tokens_decoder.
        if "added_tokens_decoder" not in config:
            values.update(_read_json(directory / "special_tokens_map.json"))
        _add_config_tokens(backend, config.get("added_tokens_decoder") or {})
        return cls(
            backend,
            _named_tokens(values),
            chat_template=_chat_template(directory, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF's `tokenizer.ggml.*` metadata describes."""
        gguf = load_or_build(md, _checked_gguf_tokenizer)  # a warm start reads it from the cache
        named = {k: tokenizers.AddedToken(gguf.names[k], special=True, normalized=False)
                 for k in ("bos_token", "eos_token", "unk_token", "pad_token") if gguf.names[k] is not None}
        return cls(gguf.backend, named, chat_template=gguf.names["chat_template"])

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object, for libraries that read the vocabulary themselves (grammar engines)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True, truncate_to: int | None = None) -> list[int]:
        """`truncate_to`: at most that many tokens, dropping the text's start but keeping the special
        tokens (vLLM's truncation side for embeddings)."""
        if truncate_to is None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        encoding = self._backend.encode(text, add_special_tokens=False)
        specials = self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(truncate_to - specials, 0), direction="left")
        return self._backend.post_process(encoding, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"tokenizer: token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ChatTemplateError("the model has no chat template")
        from vllmpy.tokenizer.chat_template import render_chat  # jinja2 is imported on first use only

        special = {k: self._named[k] for k in ("bos_token", "eos_token") if k in self._named}
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            special_tokens=special,
            extra=chat_template_kwargs,
        )

    def _id_of(self, name: str) -> int | None:
        token = self._named.get(name)
        return None if token is None else self._backend.token_to_id(token)


def _checked_gguf_tokenizer(md: Mapping[str, Any]) -> GgufTokenizer:
    gguf = tokenizer_from_gguf(md)
    check_merges(gguf.tokenizer_json["model"])
    return gguf


def check_merges(model: dict[str, Any]) -> None:
    """Refuse a BPE whose merges name a token the vocabulary lacks, naming the token and its rank."""
    if model.get("type") != "BPE":
        return
    vocab = model.get("vocab") or {}
    for rank, merge in enumerate(model.get("merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if len(pair) != 2:
            raise ValueError(f"tokenizer: merge at merge rank {rank} ({merge!r}) is not a pair of tokens")
        left, right = pair
        for token in (left, right, left + right):
            if token not in vocab:
                raise ValueError(
                    f'tokenizer: merge token "{token}" at merge rank {rank} ("{left} {right}") is not in the vocabulary'
                )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _added_token(value: str | dict, special: bool = True) -> tokenizers.AddedToken:
    """A config's token, written as a string or as a serialized AddedToken (whose own flags win)."""
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=special, normalized=False)
    flags = {"special": special, **{k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value}}
    return tokenizers.AddedToken(value["content"], **flags)


def _named_tokens(values: dict[str, Any]) -> dict[str, tokenizers.AddedToken]:
    """The special tokens a config names: bos/eos/... plus its extra special token list or map."""
    named = {k: _added_token(values[k]) for k in _NAMED_SPECIAL if isinstance(values.get(k), (str, dict))}
    extra = values.get("extra_special_tokens") or values.get("additional_special_tokens") or []
    for index, value in enumerate(extra.values() if isinstance(extra, dict) else extra):
        named[f"extra_{index}"] = _added_token(value)
    return named


def _add_config_tokens(backend: tokenizers.Tokenizer, decoder: dict[str, dict]) -> None:
    """Add tokens tokenizer_config.json declares that tokenizer.json does not already hold."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [_added_token(v, special=False) for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    backend.add_tokens([t for t in missing if t.content not in present])


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5) wins over the config's template string or "default" entry."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: drop the space WordPiece-style decoders leave before punctuation."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
