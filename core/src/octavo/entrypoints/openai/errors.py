"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every error the server returns goes through here: ``OpenAIError`` raised by handlers,
FastAPI's request validation (422 remapped to 400), Starlette's 404/405/413, a dead engine
(503) and anything unexpected (500, logged).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from octavo.engine.core_client import EngineDeadError, EngineShuttingDownError

logger = logging.getLogger(__name__)

# Default error type per status (OpenAI's names where it has one).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error object."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code)

    def to_sse(self) -> str:
        """The error as a server-sent event (for errors after a stream has started)."""
        return f"data: {json.dumps(self.to_dict())}\n\n"


def engine_dead_error(exc: BaseException) -> OpenAIError:
    """503 for a request the engine cannot serve: it died, or the server is shutting down."""
    if isinstance(exc, EngineShuttingDownError):
        return OpenAIError(f"the server is shutting down: {exc}; retry on another server", 503,
                           code="server_shutting_down")
    return OpenAIError(f"the engine is not running: {exc}", 503, code="engine_dead")


def error_response(message: str, status_code: int, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return OpenAIError(message, status_code, param=param, code=code).to_response()


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """One 400 naming each invalid field (``messages[0].role: Input should be ...``)."""
    problems = []
    first_param = None
    for error in exc.errors():
        loc = [part for part in error.get("loc", ()) if part != "body"]
        # pydantic adds the union member tried to the location (e.g. 'str', 'list[int]').
        loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"}))]
        param = ""
        for part in loc:
            param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
        if error.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}".strip())
            continue
        if error.get("type") == "missing" and not param:
            problems.append("a JSON request body is required")
            continue
        first_param = first_param or param or None
        problems.append(f"{param}: {error.get('msg')}" if param else str(error.get("msg")))
    # Union fields report one error per member: keep each message once, in order.
    message = "; ".join(dict.fromkeys(problems)) or "invalid request"
    return OpenAIError(message, 400, param=first_param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif exc.status_code == 413:
            message, code = str(exc.detail), "request_too_large"
        else:
            message, code = str(exc.detail), None
        response = error_response(message, exc.status_code, code=code)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return engine_dead_error(exc).to_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500,
                              code="internal_error")
