"""POST /tokenize and /detokenize: the server's own tokenizer and chat template, as vLLM exposes them."""
from __future__ import annotations

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from vllmpy.entrypoints.openai.serving_engine import ServingContext


def tokenize(ctx: ServingContext, request: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(request.model)
    if isinstance(request, TokenizeChatRequest):
        text, param = ctx.render_chat(request), "messages"
    else:
        text, param = request.prompt, "prompt"
    token_ids = ctx.encode(text, request.add_special_tokens, param)
    token_strs = [ctx.tokenizer.id_to_token(t) for t in token_ids] if request.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids,
                            token_strs=token_strs)


def detokenize(ctx: ServingContext, request: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(request.model)
    bad = [t for t in request.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is out of range [0, {ctx.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens))
