"""503 `backend_unavailable` + Retry-After on every HTTP surface while the database is away.

When Postgres dies (or an external one becomes unreachable) the service keeps running and
answers, instead of a raw 500, 503 with `Retry-After` and the coded body
`{"error": {"code": "backend_unavailable", "message": ...}}`; the web UI gets a plain 503 page.
Two hooks, because two kinds of app serve requests:
- Django (REST, web UI, admin, /healthz): `handler500` sees the exception Django caught
  (from a view or a middleware) and turns a lost database into the 503.
- Raw ASGI (the MCP app, whose bearer authentication reads the database before the SDK runs):
  `BackendUnavailableMiddleware` catches the exception before the response started. It also
  adds Retry-After to any 503 answered without one (e.g. a service's backend_unavailable error).
A statement over one of the database's limits (SQLSTATE class 54, core.db_errors) is the
request's size, not an outage: both hooks answer it 413 `payload_too_large` instead of a
503 or a 500.
"""

from __future__ import annotations

import json
import logging
import sys

from django.http import HttpResponse, JsonResponse
from django.views import defaults

from core.db_errors import PROGRAM_LIMIT_MESSAGE, is_backend_unavailable, is_program_limit_exceeded

__all__ = ["is_backend_unavailable", "is_program_limit_exceeded", "server_error", "BackendUnavailableMiddleware"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
CODE = "backend_unavailable"
MESSAGE = "The database is unavailable; retry later."
_JSON_PREFIXES = ("/v1/", "/engines/", "/healthz", "/.well-known/")
_PAGE = (
    "<!doctype html><html><head><title>Temporarily unavailable</title></head><body>"
    "<h1>Temporarily unavailable</h1><p>memsite cannot reach its database right now. "
    "Please try again in a few seconds.</p></body></html>"
)


TOO_LARGE_CODE = "payload_too_large"
TOO_LARGE_MESSAGE = PROGRAM_LIMIT_MESSAGE


def _wants_json(path: str, accept: str) -> bool:
    return path.startswith(_JSON_PREFIXES) or ("application/json" in accept and "text/html" not in accept)


def unavailable_response(request) -> HttpResponse:
    response: HttpResponse
    if _wants_json(request.path, request.headers.get("accept", "")):
        response = JsonResponse({"error": {"code": CODE, "message": MESSAGE}}, status=503)
    else:
        response = HttpResponse(_PAGE, status=503, content_type="text/html; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def too_large_response(request) -> HttpResponse:
    if _wants_json(request.path, request.headers.get("accept", "")):
        return JsonResponse({"error": {"code": TOO_LARGE_CODE, "message": TOO_LARGE_MESSAGE}}, status=413)
    page = f"<!doctype html><html><body><h1>Request too large</h1><p>{TOO_LARGE_MESSAGE}</p></body></html>"
    return HttpResponse(page, status=413, content_type="text/html; charset=utf-8")


def server_error(request, *args, **kwargs):
    """Django's handler500: called inside the `except` that caught the view's exception."""
    exc = sys.exc_info()[1]
    if is_program_limit_exceeded(exc):
        return too_large_response(request)
    if is_backend_unavailable(exc):
        return unavailable_response(request)
    return defaults.server_error(request, *args, **kwargs)


class BackendUnavailableMiddleware:
    """ASGI wrapper: a lost database before the response started becomes a coded 503."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_with_retry_after(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers") or [])
                if message["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", str(RETRY_AFTER_S).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_retry_after)
        except Exception as exc:
            too_large = is_program_limit_exceeded(exc)
            if started or not (too_large or is_backend_unavailable(exc)):
                raise
            # The type only: a driver's message can quote the statement's data.
            what = "statement over a database limit" if too_large else "database unavailable"
            logger.warning("%s while serving %s: %s", what, scope.get("path"), type(exc).__name__)
            status, code, message = (413, TOO_LARGE_CODE, TOO_LARGE_MESSAGE) if too_large else (503, CODE, MESSAGE)
            body = json.dumps({"error": {"code": code, "message": message}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if not too_large:
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
