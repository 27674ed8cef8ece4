"""The stop pass: every reason a generation ends, checked in one place, token by token.

A step may bring a request several new tokens (speculative decoding accepts a run of them): they are
appended one at a time and checked after each, so the first stop among them wins and the tokens after
it are dropped, exactly as if they had arrived one per step. Per token, in this order:

1. EOS (unless ignore_eos) and stop_token_ids, once min_tokens outputs exist (stop_reason: the id);
2. stop strings, once min_tokens outputs exist, on the request's detokenized text: only its tail that
   can hold a match ending in the new text is searched; the visible text is cut there
   (`Request.output_text_len`, including the stop string if include_stop_str_in_output);
3. a completed grammar (on the step's last token: the runner advances the grammar), even before
   min_tokens, since nothing may follow it;
4. max_tokens and max_model_len (finish reason "length").

A check that raises fails only its own request (FINISHED_ERROR, `error` naming what raised).
"""
from __future__ import annotations

import logging

from vllmpy.engine.request import Request, RequestStatus

logger = logging.getLogger("vllmpy")


def apply_new_tokens(request: Request, new_tokens: list[int], max_model_len: int,
                     grammar_terminated: bool = False) -> RequestStatus | None:
    """Append `new_tokens` up to the first that stops `request`; returns its finish status, or None."""
    try:
        for i, token_id in enumerate(new_tokens):
            request.append_output_token(token_id)
            status = check_stop(request, token_id, max_model_len, grammar_terminated and i == len(new_tokens) - 1)
            if status is not None:
                return status
    except Exception as exc:
        logger.exception("the stop check of request %s failed", request.request_id)
        request.error = f"its stop check raised {type(exc).__name__}: {exc}"
        return RequestStatus.FINISHED_ERROR
    return None


def check_stop(request: Request, token_id: int, max_model_len: int, grammar_terminated: bool) -> RequestStatus | None:
    """Whether the just-appended `token_id` ends `request`; sets stop_reason (and the text cut)."""
    params = request.sampling_params
    text_before = _advance_text(request, token_id)
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.stop and text_before is not None and _match_stop_string(request, text_before):
            return RequestStatus.FINISHED_STOPPED
    if grammar_terminated:
        request.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def _advance_text(request: Request, token_id: int) -> int | None:
    """Feed the token to the request's detokenizer; the text length before it (None: no detokenizer)."""
    detokenizer = request.detokenizer
    if detokenizer is None:
        return None
    before = len(detokenizer.output_text)
    detokenizer.add_tokens([token_id])
    return before


def _match_stop_string(request: Request, text_before: int) -> bool:
    """The first of `stop` (in the request's order) that ends after `text_before`: earlier text was
    already searched, so only the last len(stop) - 1 characters before it can start a new match."""
    params = request.sampling_params
    text = request.detokenizer.output_text
    if len(text) == text_before:
        return False
    for stop in params.stop:
        at = text.find(stop, max(0, text_before - len(stop) + 1))
        if at != -1:
            request.output_text_len = at + len(stop) if params.include_stop_str_in_output else at
            request.stop_reason = stop
            return True
    return False
