"""Engine logprobs ({token id: Logprob} per position) in the three shapes the OpenAI routes return."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from vllmpy.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)
from vllmpy.outputs import PositionLogprobs

# JSON has no -inf; vLLM reports impossible tokens at this floor too.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_logprobs(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: logprob, rank, decoded_token}."""
    if positions is None:
        return None
    return [None if pos is None else
            {tid: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in pos.items()}
            for pos in positions]


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
                        decode: Callable[[int], str], text_offset: int = 0) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists, offsets into the choice's text, top entries by text.

    A position without logprobs (the first prompt token under echo) gets None entries, as in vLLM.
    """
    out = CompletionLogprobs()
    for token_id, pos in zip(token_ids, positions):
        chosen = pos.get(token_id) if pos is not None else None
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        out.token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
        out.top_logprobs.append(None if pos is None else
                                {lp.decoded_token or decode(tid): _finite(lp.logprob) for tid, lp in pos.items()})
    return out


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int) -> ChatLogprobs:
    """The chat shape: per token its text, logprob and UTF-8 bytes, with the top_n alternatives by rank."""
    content = []
    for token_id, pos in zip(token_ids, positions):
        chosen = pos[token_id]
        top = sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append(ChatTokenLogprob(**_chat_entry(chosen.decoded_token or "", chosen.logprob),
                                        top_logprobs=[ChatTopLogprob(**_chat_entry(lp.decoded_token or "", lp.logprob))
                                                      for lp in top]))
    return ChatLogprobs(content=content)


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}
