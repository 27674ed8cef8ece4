"""The interface every draft proposer implements (n-gram, suffix, draft model).

The engine asks a proposer for up to k draft tokens per running request once per step, from the
request's verified tokens (prompt + output so far); drafts are only hints: verification decides what
is kept, so a proposer never needs to be right, only cheap and often right.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (the request's prompt then its verified output;
        the first `num_prompt_tokens` are the prompt). [] when there is nothing worth drafting."""

    def on_request_finished(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request is done (finished or aborted): forget its state; a proposer that learns across
        requests (suffix decoding) may keep its output."""
