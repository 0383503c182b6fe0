"""One cap on every request body, before any app reads it.

Django's ASGI handler (and the REST thread pool, which reuses its `read_body`) spools a
whole body to a temporary file before the view, or authentication, runs: an anonymous
multi-gigabyte POST would be written to disk in full before its 401. The surfaces' own
limits (REST and MCP bodies 256 KiB, an import `IMPORT_MAX_BYTES`, the chat proxy's) only
apply once it is read. This wrapper refuses a body over `REQUEST_BODY_MAX_BYTES`
(default: four times the import limit) with 413 `payload_too_large` (JSON on the API
surfaces, a page elsewhere): at once when its Content-Length says so, or as soon as a
body sent without one (or under a false one) passes it, the app then seeing a disconnect.

It also reads a chunked body (no Content-Length) before the app: Django's request reads
exactly Content-Length bytes, so without one it saw an empty body (a chunked POST of a
memory answered "memory is required"). Such a body is spooled (to disk past 1 MiB, as
Django spools), and the app gets the length it needs.

In front of it, `ForeignHostBodyWithheld` hands a request whose Host ALLOWED_HOSTS does not
name to the app with an empty body: every surface refuses such a host before it reads a
body (421 on the JSON surfaces, Django's 400 page elsewhere), so that answer comes first,
whatever the body's size, and not a byte of the body is read, not even here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Callable
from typing import IO, Any

from core.hosts import host_allowed

logger = logging.getLogger(__name__)

CODE = "payload_too_large"
# Answered in JSON, as their own errors are (the REST API and chat proxy, MCP, OAuth).
JSON_PREFIXES = ("/v1/", "/engines/", "/oauth/", "/.well-known/")
SPOOL_IN_MEMORY_BYTES = 1024 * 1024
REPLAY_CHUNK_BYTES = 64 * 1024


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one itself
    return None


def _chunked_without_length(scope: dict[str, Any]) -> bool:
    names = {name.lower() for name, _ in scope.get("headers") or []}
    return b"transfer-encoding" in names and b"content-length" not in names


async def _body_spooled(receive: Any) -> tuple[IO[bytes], int] | None:
    """The whole body in a spooled file (rewound) and its size; None if the client left."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES)  # noqa: SIM115 - closed by the caller
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            spool.close()
            return None
        chunk = message.get("body", b"")
        spool.write(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            spool.seek(0)
            return spool, size


def _replaying(spool: IO[bytes], size: int, receive: Any) -> Any:
    """A receive that hands out the spooled body, then the client's own messages (its
    disconnect)."""
    sent = 0
    done = False

    async def replay() -> dict[str, Any]:
        nonlocal sent, done
        if done:
            return await receive()
        chunk = spool.read(REPLAY_CHUNK_BYTES)
        sent += len(chunk)
        done = sent >= size
        return {"type": "http.request", "body": chunk, "more_body": not done}

    return replay


class BodyLimitMiddleware:
    """ASGI wrapper: a body over `max_bytes` is answered 413 and never read whole."""

    def __init__(self, app: Any, *, max_bytes: int, reads_chunked: Callable[[str], bool] | None = None) -> None:
        """`reads_chunked(path)`: the app of that path reads a chunked body itself (the MCP
        and OAuth apps, which check the host and credentials before reading any body, with
        their own smaller caps); only the other paths (Django's) have it spooled here."""
        self.app = app
        self.max_bytes = max_bytes
        self.reads_chunked = reads_chunked or (lambda _path: False)

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

        app_receive = capped_receive
        spool: IO[bytes] | None = None
        if _chunked_without_length(scope) and not self.reads_chunked(str(scope.get("path", ""))):
            spooled = await _body_spooled(capped_receive)
            if over:
                await self._refuse(scope, send)
                return
            if spooled is None:
                return  # the client left before its body ended: no one to answer
            spool, size = spooled
            headers = [*(scope.get("headers") or []), (b"content-length", str(size).encode())]
            scope = {**scope, "headers": headers}
            app_receive = _replaying(spool, size, receive)
        try:
            await self.app(scope, app_receive, tracked_send)
        except Exception:
            if not over or started:
                raise  # the app's own failure (an app may raise on the disconnect it was shown)
        finally:
            if spool is not None:
                spool.close()
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


def _first_host(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"host":
            return str(value.decode("latin-1"))
    return None


class ForeignHostBodyWithheld:
    """ASGI wrapper, outside `BodyLimitMiddleware`. A request whose Host is not served here
    got 413 for an oversized body before any surface checked the host, and a chunked body
    to a Django path was spooled before Django refused the host. Every surface refuses a
    foreign Host before it reads a body: the MCP gate and the OAuth endpoints first thing,
    Django in its middleware (ForeignHostMiddleware, CommonMiddleware), which runs only
    after its handler has read the whole body. The app now gets such a request with an
    empty body (Content-Length 0): its refusal (421 on the JSON surfaces, Django's 400
    page elsewhere) comes first, and nothing of the body is read. Decided on the first
    Host header, as the MCP and OAuth apps check it (Django joins several into one no host
    matches: refused too); a request without one is left alone (Django then takes the
    server's own name)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        host = _first_host(scope) if scope["type"] == "http" else None
        if host is None or host_allowed(host):
            await self.app(scope, receive, send)
            return
        dropped = (b"content-length", b"transfer-encoding")
        headers = [(name, value) for name, value in scope.get("headers") or [] if name.lower() not in dropped]
        withheld = {**scope, "headers": [*headers, (b"content-length", b"0")]}
        delivered = False

        async def empty_body() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            # Never the client's own messages: they are its body. Django listens for a
            # disconnect beside the view and cancels the listener once it has answered.
            never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            return await never

        await self.app(withheld, empty_body, send)
