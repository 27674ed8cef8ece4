"""vllm-server: the OpenAI-compatible HTTP server. Routes, SSE framing, auth, startup and shutdown live here;
what a route computes lives in the serving_* modules."""
import argparse
import asyncio
import json
import logging
import os
import resource
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from vllmpy import __version__
from vllmpy.distributed.dp_client import DPAsyncLLM, start_async_engine
from vllmpy.engine.async_llm import EngineDeadError
from vllmpy.entrypoints.engine_args import add_engine_args, engine_config_from_args
from vllmpy.entrypoints.openai.anthropic_errors import AnthropicRoute
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.openapi_limits import declare_engine_limits
from vllmpy.entrypoints.openai.event_stream import EventStream, frame
from vllmpy.entrypoints.openai.http_limits import ConcurrencyLimit, ConnectionLimits, guarded_protocol
from vllmpy.entrypoints.openai.json_limits import MAX_JSON_DEPTH
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestModel,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from vllmpy.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from vllmpy.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from vllmpy.entrypoints.openai.protocol_score import (
    ClassificationRequest,
    ClassificationResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.response_store import ResponseStore
from vllmpy.entrypoints.openai.serving_chat import NO_PARSERS, ChatParsers, create_chat_completion
from vllmpy.entrypoints.openai.serving_classify import create_classify
from vllmpy.entrypoints.openai.serving_completion import create_completion
from vllmpy.entrypoints.openai.serving_embedding import create_embedding
from vllmpy.entrypoints.openai.serving_messages import count_tokens, create_message
from vllmpy.entrypoints.openai.serving_engine import ServingContext
from vllmpy.entrypoints.openai.serving_models import (
    RUNTIME_LORA_ENV,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_lora_module,
    runtime_lora_updating,
)
from vllmpy.entrypoints.openai.serving_pooling import create_pooling
from vllmpy.entrypoints.openai.serving_responses import create_response, retrieve_response
from vllmpy.entrypoints.openai.serving_score import create_rerank, create_score
from vllmpy.entrypoints.openai.serving_tokenization import detokenize, tokenize
from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.process_exit import exit_process

logger = logging.getLogger("vllmpy.server")

# On SIGTERM/SIGINT in-flight requests get this long to finish before they are aborted (a 503 to their
# client). The aborted answers and the engine's current step then get _SHUTDOWN_SLACK_S; a step still
# running after that is left behind (it cannot be interrupted), so the process is gone within GRACE + 1 s.
SHUTDOWN_GRACE_S = 2.0
_SHUTDOWN_SLACK_S = 0.5
# uvicorn's own deadline, which cancels what is left with a traceback, counts from its shutdown start
# (~0.2 s after the signal): a backstop for a client that stops reading its aborted stream.
_UVICORN_SHUTDOWN_S = SHUTDOWN_GRACE_S + 0.3
# File descriptors kept back from --limit-connections' default for the process's own files.
_RESERVED_FDS = 64
_ERROR_RESPONSES: dict = {code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-server", description="Serve a model over the OpenAI API.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients send; the first is reported (default: --model, or "
                             "'default' for the embedded model)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', Anthropic's header) on "
                             "every /v1 route (default: $VLLM_API_KEY)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template file or inline Jinja, instead of the checkpoint's")
    parser.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                        help="server-wide enable_thinking chat-template variable; neither flag leaves it unset")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how tool calls are read from the model's text: " + ", ".join(TOOL_PARSERS.names()))
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide when to call tools (tool_choice \"auto\", the default when a "
                             "request sends tools); needs --tool-call-parser")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="split reasoning_content from content: " + ", ".join(REASONING_PARSERS.names()))
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                        help="LoRA adapters served by name (needs --enable-lora): name=path, or JSON "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    _add_http_args(parser.add_argument_group("HTTP connections and CORS"))
    add_engine_args(parser)
    return parser


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    """Connection bounds (see http_limits) and vLLM's CORS flags, with vLLM's defaults."""
    group.add_argument("--timeout-keep-alive", type=_positive(float),
                       default=os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"), metavar="S",
                       help="close a connection idle this long, kept alive or never used "
                            "(default: $VLLM_HTTP_TIMEOUT_KEEP_ALIVE or 5)")
    group.add_argument("--timeout-request-read", type=_positive(float), default=30.0, metavar="S",
                       help="answer 408 and close when a request's line, headers and body have not all "
                            "arrived this long after its first byte (default: 30)")
    group.add_argument("--limit-concurrency", type=_positive(int), default=None, metavar="N",
                       help="answer 503 to a request while N are in flight; /health, /metrics and /version "
                            "are always answered (default: no limit; the engine queues)")
    group.add_argument("--limit-connections", type=_positive(int), default=None, metavar="N",
                       help="close at once a connection accepted while N are open (default: the open-file "
                            f"limit less {_RESERVED_FDS})")
    group.add_argument("--allowed-origins", type=_json_strings, default=["*"], metavar="JSON",
                       help='CORS: origins allowed, a JSON list (default: ["*"])')
    group.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                       help='CORS: methods allowed, a JSON list (default: ["*"])')
    group.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                       help='CORS: request headers allowed, a JSON list (default: ["*"])')
    group.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                       help="CORS: let browsers send cookies and Authorization cross-origin (default: no)")


def _positive(convert: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: `convert`'s value, which must be above 0."""
    def parse(value: str) -> float:
        number = convert(value)
        if number <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
        return number

    parse.__name__ = convert.__name__  # argparse names it in "invalid float value: 'x'"
    return parse


def _json_strings(value: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take (e.g. '["https://app.example"]')."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); pass a list such as '[\"*\"]'") from exc
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value}")
    return parsed


def build_app(ctx: ServingContext, api_key: str | None = None, parsers: ChatParsers = NO_PARSERS) -> FastAPI:
    app = FastAPI(title="vllmpy OpenAI-compatible server", version=__version__)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(Exception, _internal_error)
    auth = [Depends(_key_check(api_key))] if api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=auth, responses=_ERROR_RESPONSES)
    _declare_limits_in_openapi(app, ctx)

    @v1.get("/models", response_model=ModelList, description="The served names, then LoRA adapters (with parent).")
    async def list_models() -> Response:
        return _json(ctx.models.model_list())

    # `:path` because served names may hold a slash ("org/model"), which the openai client sends as is.
    @v1.get("/models/{model:path}", response_model=ModelCard, description="One served model (models.retrieve).")
    async def retrieve_model(model: str) -> Response:
        ctx.check_model(model)
        return _json(next(card for card in ctx.models.model_list().data if card.id == model))

    if runtime_lora_updating():
        logger.warning("%s is set: LoRA adapters may be loaded and unloaded at run time", RUNTIME_LORA_ENV)
        _add_lora_routes(v1, ctx)

    @v1.post("/completions", response_model=CompletionResponse,
             description="With stream=true the answer is text/event-stream of CompletionStreamResponse chunks.")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_completion(ctx, body))

    @v1.post("/chat/completions", response_model=ChatCompletionResponse,
             description="With stream=true the answer is text/event-stream of ChatCompletionStreamResponse chunks.")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_chat_completion(ctx, body, parsers))

    @v1.post("/embeddings", response_model=EmbeddingResponse,
             description="Needs an embedding model (BertModel, LlamaModel, ... or --task embed).")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_embedding(ctx, body))

    # Pooling routes, at vLLM's paths (/score and /rerank under /v1 and /v2 as well), behind the same key.
    @app.post("/score", response_model=ScoreResponse, dependencies=auth, responses=_ERROR_RESPONSES)
    @v1.post("/score", response_model=ScoreResponse,
             description="text_1 x text_2 (1:1, 1:N or N:N): a cross-encoder's relevance, or for an embedding "
                         "model the cosine similarity of the two embeddings.")
    async def score(body: ScoreRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_score(ctx, body))

    @app.post("/rerank", response_model=RerankResponse, dependencies=auth, responses=_ERROR_RESPONSES)
    @app.post("/v2/rerank", response_model=RerankResponse, dependencies=auth, responses=_ERROR_RESPONSES)
    @v1.post("/rerank", response_model=RerankResponse,
             description="Jina / Cohere rerank: documents by relevance to the query, the best top_n.")
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_rerank(ctx, body))

    @app.post("/classify", response_model=ClassificationResponse, dependencies=auth, responses=_ERROR_RESPONSES,
              description="Needs a sequence-classification model (*ForSequenceClassification).")
    async def classify(body: ClassificationRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_classify(ctx, body))

    @app.post("/pooling", response_model=PoolingResponse, dependencies=auth, responses=_ERROR_RESPONSES,
              description="The pooler's output: an embedding, or a classifier's activated logits.")
    async def pooling(body: PoolingRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_pooling(ctx, body))

    responses_store = ResponseStore()

    @v1.post("/responses", response_model=ResponseObject,
             description="OpenAI's Responses API; with stream=true the answer is text/event-stream of typed events "
                         "(response.created ... response.completed).")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_response(ctx, body, parsers, responses_store))

    @v1.get("/responses/{response_id}", response_model=ResponseObject,
            description="A response created with store (the last ones only: the store is bounded).")
    async def retrieve_response_route(response_id: str) -> Response:
        return _json(retrieve_response(responses_store, response_id))

    app.include_router(v1)
    # Anthropic's Messages API: the same auth (x-api-key or a bearer token), errors in Anthropic's shape.
    anthropic = APIRouter(prefix="/v1", dependencies=auth, route_class=AnthropicRoute,
                          responses={code: {"model": AnthropicErrorResponse} for code in _ERROR_RESPONSES})

    @anthropic.post("/messages", response_model=MessagesResponse,
                    description="With stream=true the answer is text/event-stream of Anthropic's events "
                                "(message_start ... message_stop).")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await _respond(raw, body, create_message(ctx, body, parsers))

    @anthropic.post("/messages/count_tokens", response_model=CountTokensResponse)
    async def messages_count_tokens(body: CountTokensRequest) -> Response:
        _log_ignored(body)
        return _json(count_tokens(ctx, body))

    app.include_router(anthropic)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest) -> Response:
        _log_ignored(body)
        return _json(tokenize(ctx, body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        _log_ignored(body)
        return _json(detokenize(ctx, body))

    @app.get("/health", response_class=Response, responses={
        200: {"description": "the engine is serving; empty body"},
        503: {"model": ErrorResponse, "description": "the engine loop has died; the message names the cause"}})
    async def health() -> Response:
        return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if ctx.engine.errored else HTTPStatus.OK)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return _json(VersionResponse(version=__version__))

    @app.get("/metrics", response_class=PlainTextResponse, description="Prometheus text exposition format.")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    return app


# ---------------------------------------------------------------- responses and errors


def _add_lora_routes(v1: APIRouter, ctx: ServingContext) -> None:
    """vLLM's runtime adapter routes; the answer is plain text, as vLLM's."""
    @v1.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await ctx.models.load(body))

    @v1.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await ctx.models.unload(body))


def _declare_limits_in_openapi(app: FastAPI, ctx: ServingContext) -> None:
    """/openapi.json with this server's n, logprobs, truncation and token-id bounds (built once, on first use)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            declare_engine_limits(build(), ctx.max_num_seqs, ctx.max_logprobs, ctx.vocab_size, ctx.max_model_len)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _json(model: BaseModel, status: int = HTTPStatus.OK) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _error_body(exc: RequestError) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param,
                                         code=exc.status))


async def _request_error(_: Request, exc: RequestError) -> Response:
    return _json(_error_body(exc), exc.status)


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    """Malformed JSON and wrong types are the client's: 400 naming the field, as vLLM answers."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return await _request_error(_, RequestError(f"malformed JSON body: {first.get('ctx', {}).get('error')}"))
    parts = [[str(p) for p in e["loc"] if p != "body"] for e in errors]
    message = "; ".join(f"{'.'.join(p) or 'body'}: {e['msg']}" for p, e in zip(parts, errors))
    # The first field name in the location (union branches such as 'list[int]' are not field names).
    param = next((p for p in parts[0] if p.isidentifier() and not p[:1].isupper()), None) if parts else None
    return await _request_error(_, RequestError(message, param))


async def _http_error(_: Request, exc: HTTPException) -> Response:
    response = await _request_error(_, RequestError(_body_parse_message(exc), None, HTTPStatus(exc.status_code)))
    response.headers.update(exc.headers or {})  # a 405's Allow, which RFC 9110 requires
    return response


def _body_parse_message(exc: HTTPException) -> str:
    """FastAPI says only "There was an error parsing the body"; the cause it chains says what was wrong."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return (f"the JSON body nests objects and arrays too deeply to parse; at most {MAX_JSON_DEPTH} levels "
                f"are accepted")
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start}); send JSON as UTF-8"
    return str(exc.detail)


def _dead_engine_error(exc: EngineDeadError) -> RequestError:
    """Every request of a dead engine is a 503 naming the cause; the server is exiting to be restarted."""
    return RequestError(f"{exc}; the server is exiting", None, HTTPStatus.SERVICE_UNAVAILABLE)


async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
    return await _request_error(_, _dead_engine_error(exc))


async def _internal_error(_: Request, exc: Exception) -> Response:
    logger.error("internal error: %r", exc)
    return await _request_error(_, RequestError(f"internal error: {exc}", None, HTTPStatus.INTERNAL_SERVER_ERROR))


def _key_check(api_key: str):
    """The API key as a bearer token (OpenAI's clients) or in x-api-key (Anthropic's)."""
    bearer = HTTPBearer(auto_error=False)
    x_api_key = APIKeyHeader(name="x-api-key", auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
                    header_key: str | None = Depends(x_api_key)) -> None:
        sent = [key for key in (credentials.credentials if credentials else None, header_key) if key is not None]
        if not any(secrets.compare_digest(key.encode(), api_key.encode()) for key in sent):
            raise RequestError("Unauthorized: send the server's API key as 'Authorization: Bearer <key>' or in "
                               "the x-api-key header", None, HTTPStatus.UNAUTHORIZED)

    return check


def _log_ignored(body: RequestModel) -> None:
    if body.model_extra:
        logger.warning("ignored request fields: %s", ", ".join(sorted(body.model_extra)))


async def _respond(raw: Request, body: RequestModel, work: Coroutine[Any, Any, Any]) -> Response:
    """Run a route's work, abandoning it if the client disconnects; stream it as SSE if it is a stream."""
    _log_ignored(body)
    result = await _until_disconnect(raw, work)
    if result is None:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    if isinstance(result, BaseModel):
        return _json(result)
    if isinstance(result, EventStream):
        return StreamingResponse(_event_sse(result), media_type="text/event-stream")
    return StreamingResponse(_sse(result), media_type="text/event-stream")


async def _until_disconnect(raw: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """work's result, or None if the client went away first (work is then cancelled, aborting its request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _sse(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, an error event if the stream fails, then [DONE]."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:  # the client gets the failure in-band
        yield f"data: {_error_body(_stream_error(exc)).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


async def _event_sse(stream: EventStream) -> AsyncIterator[str]:
    """Typed server-sent events (Responses, Anthropic Messages); a failure ends them with the API's error event."""
    try:
        async with aclosing(stream.events) as events:
            async for event in events:
                yield frame(event)
    except Exception as exc:
        yield frame(stream.error_event(_error_body(_stream_error(exc)).error))


def _stream_error(exc: Exception) -> RequestError:
    """A failure after the stream began, as the refusal its error event reports."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, EngineDeadError):
        return _dead_engine_error(exc)
    logger.error("stream failed: %r", exc)  # an engine failure mid-stream
    return RequestError(f"internal error: {exc}", None, HTTPStatus.INTERNAL_SERVER_ERROR)


# ---------------------------------------------------------------- startup and shutdown


def default_chat_template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Server-wide template variables; passing neither --enable-thinking flag leaves the variable unset."""
    return {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}


def _load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


async def _serve(server: uvicorn.Server, ctx: ServingContext) -> float:
    """Serve until a signal or the engine's death; print the URL once bound; on shutdown give requests
    SHUTDOWN_GRACE_S, then stop. Returns the time.monotonic() by which the engine must have stopped."""
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"vllm-server: serving {ctx.model_name} at http://{host}:{port}/v1", flush=True)
    while not server.should_exit and not serving.done():
        if ctx.engine.errored:  # a dead engine cannot serve: exit, for a supervisor to restart us
            server.should_exit = True
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while server.server_state.connections and time.monotonic() < deadline and not serving.done():
        await asyncio.sleep(0.05)
    ctx.stop()
    await serving
    return deadline + _SHUTDOWN_SLACK_S


def _add_http_middleware(app: FastAPI, args: argparse.Namespace) -> None:
    """The in-flight cap inside CORS, so that a browser can read even its 503."""
    if args.limit_concurrency is not None:
        app.add_middleware(ConcurrencyLimit, limit=args.limit_concurrency)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                       allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


def _uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    max_connections = args.limit_connections or _default_max_connections()
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, lifespan="off",
                          timeout_graceful_shutdown=_UVICORN_SHUTDOWN_S, timeout_keep_alive=args.timeout_keep_alive,
                          http=guarded_protocol(ConnectionLimits(args.timeout_request_read, max_connections)))


def _default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return sys.maxsize if soft == resource.RLIM_INFINITY else max(1, soft - _RESERVED_FDS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    from vllmpy.errors import UnsupportedCheckpointError

    try:
        chat_template = _load_chat_template(args.chat_template)
        parsers = ChatParsers.from_flags(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
        engine = start_async_engine(engine_config_from_args(args))  # DPAsyncLLM at --data-parallel-size > 1
    except (ValueError, OSError, UnsupportedCheckpointError) as exc:
        print(f"vllm-server: error: {exc}", file=sys.stderr)
        return 2
    try:
        names = args.served_model_name or [args.model or "default"]
        ctx = ServingContext(engine, names, engine.engine.core.checkpoint.path, chat_template=chat_template,
                             chat_template_kwargs=default_chat_template_kwargs(args))
        if isinstance(engine, DPAsyncLLM):
            engine.export_metrics(ctx.metrics.registry)
        try:
            ctx.models.load_static(args.lora_modules or [])
        except ValueError as exc:
            print(f"vllm-server: error: {exc}", file=sys.stderr)
            engine.shutdown()
            return 2
        app = build_app(ctx, args.api_key, parsers)
        _add_http_middleware(app, args)
        server = uvicorn.Server(_uvicorn_config(app, args))

        def request_exit(*_: Any) -> None:
            server.should_exit = True

        # uvicorn re-raises the signal that stopped it under the handler it found, so that handler must
        # not be Python's default (which would kill us with the signal, or raise KeyboardInterrupt).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_exit)
        exit_by = asyncio.run(_serve(server, ctx))
    except BaseException:
        engine.shutdown()
        raise
    # A step cannot be interrupted: one still running at exit_by is left behind.
    stopped = engine.shutdown(timeout=max(0.0, exit_by - time.monotonic()))
    if engine.errored:  # non-zero, so that a supervisor restarts the server
        print(f"vllm-server: error: {engine.death}; exiting", file=sys.stderr)
    elif not stopped:
        logger.warning("the engine is still inside a step %.1f s after shutdown began; exiting without it",
                       SHUTDOWN_GRACE_S + _SHUTDOWN_SLACK_S)
    exit_process(1 if engine.errored else 0)


if __name__ == "__main__":
    sys.exit(main())
