"""Turn generated ids into text as they arrive, without ever emitting half a character.

Decoding only the new ids is wrong: byte-level and byte-fallback tokens can split a UTF-8
character, and SentencePiece decoders change a token's leading space by position. So each step
decodes a short window of already-emitted ids (the prefix) with and without the new ones, and
emits the difference once it no longer ends in U+FFFD, as vLLM's prefix/read offsets do.
"""

from vllmpy.tokenizer.tokenizer import Tokenizer

# Prompt ids kept as context for the first window, enough to settle the first generated token's spacing.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's generated ids, handed out as deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)
        self._text = ""

    @property
    def output_text(self) -> str:
        """All generated text emitted so far."""
        return self._text

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append ids and return only the text they complete (possibly empty while a character is open)."""
        self._ids.extend(new_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT):
            return ""
        delta = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
