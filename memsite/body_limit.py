"""One cap on every request body, before any app reads it.

Django's ASGI handler (and the REST thread pool, which reuses its `read_body`) spools a
whole body to a temporary file before the view, or authentication, runs: an anonymous
multi-gigabyte POST would be written to disk in full before its 401. The surfaces' own
limits (REST and MCP bodies 256 KiB, an import `IMPORT_MAX_BYTES`, the chat proxy's) only
apply once it is read. This wrapper refuses a body over `REQUEST_BODY_MAX_BYTES`
(default: four times the import limit) with 413 `payload_too_large` (JSON on the API
surfaces, a page elsewhere): at once when its Content-Length says so, or as soon as a
body sent without one (or under a false one) passes it, the app then seeing a disconnect.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

CODE = "payload_too_large"
# Answered in JSON, as their own errors are (the REST API and chat proxy, MCP, OAuth).
JSON_PREFIXES = ("/v1/", "/engines/", "/oauth/", "/.well-known/")


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one itself
    return None


class BodyLimitMiddleware:
    """ASGI wrapper: a body over `max_bytes` is answered 413 and never read whole."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, send)
            return
        received = 0
        over = False
        started = False

        async def capped_receive() -> dict[str, Any]:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True  # the app sees the client gone; the 413 is sent below
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, tracked_send)
        except Exception:
            if not over or started:
                raise  # the app's own failure (an app may raise on the disconnect it was shown)
        if over and not started:
            await self._refuse(scope, send)

    async def _refuse(self, scope: dict[str, Any], send: Any) -> None:
        path = str(scope.get("path", ""))
        logger.info("request body over %d bytes refused: %s", self.max_bytes, path[:100])
        message = f"The request body exceeds {self.max_bytes} bytes."
        if path.startswith(JSON_PREFIXES):
            body, content_type = json.dumps({"error": {"code": CODE, "message": message}}).encode(), b"application/json"
        else:
            page = f"<!doctype html><html><body><h1>Request too large</h1><p>{message}</p></body></html>"
            body, content_type = page.encode(), b"text/html; charset=utf-8"
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
