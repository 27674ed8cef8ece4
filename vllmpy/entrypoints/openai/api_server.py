"""vllm-server: the OpenAI-compatible HTTP server. Routes, SSE framing, auth, startup and shutdown live here;
what a route computes lives in the serving_* modules."""
import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from vllmpy import __version__
from vllmpy.entrypoints.engine_args import add_engine_args, engine_config_from_args
from vllmpy.entrypoints.openai.errors import RequestError
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
from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.serving_chat import NO_PARSERS, ChatParsers, create_chat_completion
from vllmpy.entrypoints.openai.serving_completion import create_completion
from vllmpy.entrypoints.openai.serving_embedding import create_embedding
from vllmpy.entrypoints.openai.serving_engine import ServingContext
from vllmpy.entrypoints.openai.serving_tokenization import detokenize, tokenize
from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("vllmpy.server")

# On SIGTERM/SIGINT in-flight requests get this long to finish before they are aborted (a 503 to their
# client); uvicorn's own deadline, which would cancel them with a traceback, is only a backstop.
SHUTDOWN_GRACE_S = 2.0
_UVICORN_SHUTDOWN_S = SHUTDOWN_GRACE_S + 3.0
_ERROR_RESPONSES: dict = {code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-server", description="Serve a model over the OpenAI API.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients send; the first is reported (default: --model, or "
                             "'default' for the embedded model)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $VLLM_API_KEY)")
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
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser)
    return parser


def build_app(ctx: ServingContext, api_key: str | None = None, parsers: ChatParsers = NO_PARSERS) -> FastAPI:
    app = FastAPI(title="vllmpy OpenAI-compatible server", version=__version__)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer_check(api_key))] if api_key else [],
                   responses=_ERROR_RESPONSES)
    models = ModelList(data=[ModelCard(id=name, root=ctx.model_root, max_model_len=ctx.max_model_len)
                             for name in ctx.served_model_names])

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> Response:
        return _json(models)

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

    app.include_router(v1)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest) -> Response:
        _log_ignored(body)
        return _json(tokenize(ctx, body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        _log_ignored(body)
        return _json(detokenize(ctx, body))

    @app.get("/health", responses={503: {"description": "the engine loop has died"}})
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
    return await _request_error(_, RequestError(str(exc.detail), None, HTTPStatus(exc.status_code)))


async def _internal_error(_: Request, exc: Exception) -> Response:
    logger.error("internal error: %r", exc)
    return await _request_error(_, RequestError(f"internal error: {exc}", None, HTTPStatus.INTERNAL_SERVER_ERROR))


def _bearer_check(api_key: str):
    bearer = HTTPBearer(auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise RequestError("Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
                               None, HTTPStatus.UNAUTHORIZED)

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
    except RequestError as exc:
        yield f"data: {_error_body(exc).model_dump_json()}\n\n"
    except Exception as exc:  # an engine failure mid-stream: the client gets it in-band
        logger.error("stream failed: %r", exc)
        error = RequestError(f"internal error: {exc}", None, HTTPStatus.INTERNAL_SERVER_ERROR)
        yield f"data: {_error_body(error).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


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


async def _serve(server: uvicorn.Server, ctx: ServingContext) -> None:
    """Serve until a signal; print the URL once bound; on shutdown give requests SHUTDOWN_GRACE_S, then stop."""
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"vllm-server: serving {ctx.model_name} at http://{host}:{port}/v1", flush=True)
    while not server.should_exit and not serving.done():
        await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_GRACE_S
    while server.server_state.connections and loop.time() < deadline and not serving.done():
        await asyncio.sleep(0.05)
    ctx.stop()
    await serving


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    from vllmpy.engine.async_llm import AsyncLLM
    from vllmpy.errors import UnsupportedCheckpointError

    try:
        chat_template = _load_chat_template(args.chat_template)
        parsers = ChatParsers.from_flags(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
        engine = AsyncLLM(engine_config_from_args(args))
    except (ValueError, OSError, UnsupportedCheckpointError) as exc:
        print(f"vllm-server: error: {exc}", file=sys.stderr)
        return 2
    try:
        names = args.served_model_name or [args.model or "default"]
        ctx = ServingContext(engine, names, engine.engine.core.checkpoint.path, chat_template=chat_template,
                             chat_template_kwargs=default_chat_template_kwargs(args))
        config = uvicorn.Config(build_app(ctx, args.api_key, parsers), host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level, lifespan="off",
                                timeout_graceful_shutdown=_UVICORN_SHUTDOWN_S)
        server = uvicorn.Server(config)

        def request_exit(*_: Any) -> None:
            server.should_exit = True

        # uvicorn re-raises the signal that stopped it under the handler it found, so that handler must
        # not be Python's default (which would kill us with the signal, or raise KeyboardInterrupt).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_exit)
        asyncio.run(_serve(server, ctx))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
