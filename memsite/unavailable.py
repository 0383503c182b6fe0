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
"""

from __future__ import annotations

import json
import logging
import sys

from django.http import HttpResponse, JsonResponse
from django.views import defaults

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


def _unavailable_types() -> tuple[type[BaseException], ...]:
    import django.db
    import psycopg
    import psycopg_pool

    return (
        django.db.OperationalError,
        django.db.InterfaceError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        psycopg_pool.PoolTimeout,
    )


def is_backend_unavailable(exc: BaseException | None) -> bool:
    """True when `exc`, or an exception it was raised from, says the database is unreachable
    (connection refused or lost, server shutting down, pool exhausted while it reconnects)."""
    types = _unavailable_types()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, types):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


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


def server_error(request, *args, **kwargs):
    """Django's handler500: called inside the `except` that caught the view's exception."""
    if is_backend_unavailable(sys.exc_info()[1]):
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
            if started or not is_backend_unavailable(exc):
                raise
            # The type only: a driver's message can quote the statement's data.
            logger.warning("database unavailable while serving %s: %s", scope.get("path"), type(exc).__name__)
            body = json.dumps({"error": {"code": CODE, "message": MESSAGE}}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", str(RETRY_AFTER_S).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
