"""Prompt-lookup (n-gram) drafting, vLLM's `ngram` method: the tokens that followed an earlier occurrence of
the context's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs.

vLLM's semantics: the longest n wins; among occurrences of that n-gram the *earliest* one is used (in a
prompt being copied or edited, the first occurrence is the original text); the occurrence may overlap the
suffix itself; up to k tokens follow it (fewer when the context ends sooner).

vLLM rescans the whole context every step (KMP over the reversed tokens, O(context) per call). Here each
request keeps, per n, a dict from n-gram to the end of its first occurrence, fed only the tokens that arrived
since the last call, so a step costs O(new tokens x (max - min + 1)) whatever the context length.
"""
from __future__ import annotations

from collections.abc import Sequence


class _RequestIndex:
    """First occurrence of every n-gram (n in lengths) of one request's tokens, grown incrementally."""

    def __init__(self, lengths: range) -> None:
        self.lengths = lengths
        self._reset()

    def _reset(self) -> None:
        # first_end[n][ngram]: the index just past the n-gram's first occurrence.
        self.first_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.lengths}
        self.num_indexed = 0
        self.last_token: int | None = None

    def update(self, token_ids: Sequence[int]) -> None:
        """Index the n-grams that end in the tokens appended since the last update."""
        total = len(token_ids)
        if total < self.num_indexed or (self.num_indexed and token_ids[self.num_indexed - 1] != self.last_token):
            self._reset()  # not an extension of what was indexed: start over
        start = max(0, self.num_indexed - self.lengths.stop + 2)
        window = list(token_ids[start:total])
        for n in self.lengths:
            index = self.first_end[n]
            for last in range(max(self.num_indexed, n - 1), total):  # index of the n-gram's last token
                index.setdefault(tuple(window[last + 1 - n - start:last + 1 - start]), last + 1)
        self.num_indexed = total
        self.last_token = token_ids[total - 1] if total else None

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        total = len(token_ids)
        for n in reversed(self.lengths):
            if n > total:
                continue
            end = self.first_end[n].get(tuple(token_ids[total - n:total]), total)
            if end < total:  # an occurrence before the suffix itself
                return list(token_ids[end:min(end + k, total)])
        return []


class NgramProposer:
    """Drafts by prompt lookup over each request's own prompt + output."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must be >= 1 and <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.lengths = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._requests: dict[str, _RequestIndex] = {}

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        if k <= 0:
            return []
        index = self._requests.get(req_id)
        if index is None:
            index = self._requests[req_id] = _RequestIndex(self.lengths)
        index.update(token_ids)
        return index.lookup(token_ids, k)

    def on_request_finished(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._requests.pop(req_id, None)
