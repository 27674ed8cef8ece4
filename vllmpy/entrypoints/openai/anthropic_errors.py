"""Refusals of the Anthropic routes in Anthropic's shape, {"type": "error", "error": {"type", "message"}}.

The server's own exception handlers still word every refusal (so a 400 names the field exactly as on the
OpenAI routes); AnthropicRoute catches what a route raises, lets the app's handler answer, and reshapes the
body, so the anthropic SDK raises its own exception classes (BadRequestError, AuthenticationError, ...).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from vllmpy.entrypoints.openai.protocol import ErrorInfo
from vllmpy.entrypoints.openai.protocol_anthropic import AnthropicErrorInfo, AnthropicErrorResponse

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_TIMEOUT: "timeout_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error(error: ErrorInfo) -> AnthropicErrorResponse:
    kind = _TYPES.get(error.code, "invalid_request_error" if 400 <= error.code < 500 else "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=error.message, param=error.param))


class AnthropicRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                answered = await _app_handler(request, exc)(request, exc)
                body = anthropic_error(ErrorInfo.model_validate(json.loads(answered.body)["error"]))
                return Response(body.model_dump_json(), status_code=answered.status_code,
                                headers={k: v for k, v in answered.headers.items() if k.lower() == "allow"},
                                media_type="application/json")

        return route


def _app_handler(request: Request, exc: Exception) -> Callable[..., Coroutine[Any, Any, Response]]:
    """The app's exception handler for `exc`: the one registered for its nearest class."""
    handlers = request.app.exception_handlers
    return next(handlers[cls] for cls in type(exc).__mro__ if cls in handlers)
