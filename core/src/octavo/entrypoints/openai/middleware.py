"""Pure ASGI middleware: API key check and request body size limit.

Pure ASGI on purpose: Starlette's ``BaseHTTPMiddleware`` runs the app in a separate task and
swallows ``http.disconnect``, which would keep generating for clients that are gone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, type_: str, code: str,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send a whole OpenAI error response."""
    body = json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
    })
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` except on open paths (and CORS preflights).

    Keys are compared in constant time (on their SHA-256 digests, so the length leaks too).
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str] = ("/health", "/metrics")) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(
            send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "authentication_error", "invalid_api_key",
            headers=[(b"www-authenticate", b"Bearer")],
        )

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                digest = hashlib.sha256(token.strip()).digest()
                return hmac.compare_digest(digest, self._digest)
        return False


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit (the app answers 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {max_bytes} bytes")


class BodySizeLimitMiddleware:
    """Answer 413 to request bodies over ``max_bytes`` (declared or actually sent)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError:
            if response_started:
                raise
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        await send_error(
            send, 413, f"the request body is larger than the limit of {self.max_bytes} bytes",
            "invalid_request_error", "request_too_large",
        )
