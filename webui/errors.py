"""OpenAI-style error responses, and the exception handlers that turn every failure into one."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException

from app.engine.client import EngineError
from app.engine.protocol import InvalidRequest

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


class ErrorDetail(msgspec.Struct):
    """What went wrong: a one-line message, its kind, and the request field at fault when there is one."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """The body of every error response, as OpenAI sends it."""

    error: ErrorDetail


class ApiError(Exception):
    """An error to answer with a given status and OpenAI error object (e.g. 404 model_not_found)."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message, type, param, code)


def error_type(status: int) -> str:
    """The OpenAI error type for an HTTP status."""
    return ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")


def openai_error(
    status: int,
    message: str,
    type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON response `{"error": {"message", "type", "param", "code"}}` with the given status."""
    return Response(
        ErrorResponse(ErrorDetail(message, type, param, code)),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


def _validation_error(exc: ValidationException) -> tuple[str, str | None]:
    """A message and the field at fault for a body that does not fit the request schema."""
    problems: list[dict[str, Any]] = [item for item in exc.extra or [] if isinstance(item, dict)]
    if not problems:
        return str(exc.detail), None
    message = str(problems[0].get("message", exc.detail))
    key = problems[0].get("key")
    if key not in (None, "data"):
        return f"invalid value for '{key}': {message}", str(key)
    missing = _MISSING_FIELD.search(f"{message} {exc.__cause__}")
    if missing is None:
        return f"invalid request body: {message}", None
    if missing.group(1) == "data":
        return "the request body is empty: send a JSON object", None
    return f"missing required field '{missing.group(1)}'", missing.group(1)


def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's HTTP errors: validation (400), auth (401), unknown route (404), wrong method (405)..."""
    status = exc.status_code
    param = None
    if isinstance(exc, ValidationException):
        message, param = _validation_error(exc)
    elif status == 404:
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = " ".join(str(exc.detail).split())
    return openai_error(status, message, error_type(status), param, headers=exc.headers)


def _api_error(_: Request, exc: ApiError) -> Response:
    detail = exc.detail
    return openai_error(exc.status, detail.message, detail.type, detail.param, detail.code)


def _invalid_request(_: Request, exc: InvalidRequest) -> Response:
    return openai_error(400, str(exc), "invalid_request_error", exc.param)


def _engine_error(_: Request, exc: EngineError) -> Response:
    return openai_error(503, f"the engine cannot serve the request: {exc}", "service_unavailable")


def _recursion(request: Request, exc: RecursionError) -> Response:
    """A body nested deeper than the JSON decoder goes is the client's error; any other recursion is ours."""
    if "deserializ" in str(exc):
        return openai_error(400, "the request body is nested too deeply", "invalid_request_error")
    return _internal_error(request, exc)


def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    first_line = (str(exc).strip().splitlines() or [""])[0]
    message = f"internal error: {type(exc).__name__}" + (f": {first_line}" if first_line else "")
    return openai_error(500, message, "internal_error")


EXCEPTION_HANDLERS = {
    HTTPException: _http_exception,
    ApiError: _api_error,
    InvalidRequest: _invalid_request,
    EngineError: _engine_error,
    RecursionError: _recursion,
    Exception: _internal_error,
}
