"""The one exception the serving code raises for a request it refuses; the server turns it into an
OpenAI-shaped error body with the HTTP status and the offending field."""
from __future__ import annotations

from http import HTTPStatus

# OpenAI's error type names by status, as its clients map them to exception classes.
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class RequestError(Exception):
    """A refusal: `message` says what is wrong, `param` names the request field when one is to blame."""

    def __init__(self, message: str, param: str | None = None,
                 status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    @property
    def error_type(self) -> str:
        return _ERROR_TYPES.get(self.status, self.status.phrase.replace(" ", "") + "Error")
