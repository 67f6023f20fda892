"""A cap on request bodies: a larger one is refused with a 413 before any of it is parsed or stored."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 32 * 1024 * 1024  # a long agent history is a few MB; far more is a mistake or an attack
UPLOAD_MAX_BYTES = 512 * 1024 * 1024  # a file uploaded to /v1/files: OpenAI's limit for one file
LARGER = {"/v1/files": UPLOAD_MAX_BYTES}  # the routes that take more (POST bodies), by path


class BodyLimit:
    """ASGI middleware: reads a request's body (declared length or chunked) up to ``max_bytes`` (``LARGER``'s for
    its paths), then hands it on."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.default_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = max(self.default_bytes, LARGER.get(scope["path"], 0))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, limit)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, limit: int) -> None:
        error = {
            "message": f"The request body is larger than {limit} bytes.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
        payload = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
